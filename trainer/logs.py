"""Where the trainer's messages go: named loggers in the library, handlers set once per process.

Library code logs through ``logging.getLogger(__name__)`` (``moeckpt.trainer.train``, ...) and never prints. The
live progress of a run (a line every ``--log-every`` steps, from rank 0) goes to the :data:`PROGRESS` logger.
:func:`configure_logging` is what a process's entry point calls (the ``moeckpt`` command, the torchrun worker
entry): progress to stdout, everything else to stderr as ``moeckpt: ...`` lines.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["PROGRESS", "configure_logging", "logger", "progress"]

#: the logger of the live progress lines (stdout).
PROGRESS = "moeckpt.progress"


def logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def progress() -> logging.Logger:
    return logging.getLogger(PROGRESS)


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"moeckpt: error: {text}"
        if record.levelno >= logging.WARNING:
            return f"moeckpt: warning: {text}"
        return f"moeckpt: {text}"


class _Stream(logging.StreamHandler):
    """A handler on ``sys.stdout``/``sys.stderr`` as they are at each record (tests and the CLI swap them)."""

    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which

    @property
    def stream(self):
        return getattr(sys, self.which)

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str | int = "INFO") -> None:
    """Send ``moeckpt.*`` records at ``level`` and above to stderr and progress lines to stdout (idempotent)."""
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            level = logging.INFO
    root = logging.getLogger("moeckpt")
    for h in list(root.handlers):
        if getattr(h, "_moeckpt", False):
            root.removeHandler(h)
    prog = logging.getLogger(PROGRESS)
    for h in list(prog.handlers):
        if getattr(h, "_moeckpt", False):
            prog.removeHandler(h)
    err = _Stream("stderr")
    err.setFormatter(_Prefixed())
    err._moeckpt = True  # type: ignore[attr-defined]
    root.addHandler(err)
    root.setLevel(level)
    out = _Stream("stdout")
    out.setFormatter(logging.Formatter("%(message)s"))
    out._moeckpt = True  # type: ignore[attr-defined]
    prog.addHandler(out)
    prog.propagate = False
    prog.setLevel(level)
