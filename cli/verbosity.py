"""``-v``/``-q`` on the ``moeckpt`` group: how much of the library's logging reaches the terminal.

Level 0 (the default) shows progress lines (stdout) and notices (stderr: resume, save, layout change, rollback,
restart); ``-q`` hides progress and notices (warnings and errors stay), ``-qq`` keeps errors only; ``-v`` adds
debug records, ``-vv`` also torchrun's agent's own records. The level travels to the training workers in the
environment (``MOECKPT_LOG_LEVEL``).
"""

from __future__ import annotations

import os

from moeckpt.trainer.launch import LOG_LEVEL_ENV
from moeckpt.trainer.logs import configure_logging

_LEVELS = {-2: "ERROR", -1: "WARNING", 0: "INFO", 1: "DEBUG", 2: "DEBUG"}


def setup(delta: int) -> str:
    """Configure logging for ``delta`` = (number of ``-v``) - (number of ``-q``); returns the level name."""
    level = _LEVELS[max(-2, min(2, delta))]
    configure_logging(level)
    os.environ[LOG_LEVEL_ENV] = level
    if delta >= 2:
        os.environ["MOECKPT_AGENT_VERBOSE"] = "1"
    else:
        os.environ.pop("MOECKPT_AGENT_VERBOSE", None)
    return level
