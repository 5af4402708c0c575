"""Imported only by the agent's warm fork server (the last of :data:`moeckpt.trainer.launch.WARM_MODULES`): a
worker the server forks but that cannot start ends without a traceback on the user's terminal.

The server's child runs ``sys.excepthook`` for what fails before the worker's own code runs (the worker's code has
its own error handling). The usual cause is a signal that stopped the agent while the server was forking its
workers: the agent's semaphores and pipes are already gone (``FileNotFoundError`` rebuilding a semaphore, a closed
pipe), and the agent reports the stop itself, so such a worker ends silently; anything else is one line.
"""

from __future__ import annotations

import sys

__all__ = ["quiet_start_failure"]

#: what a worker meets when the agent that asked for it has already stopped.
AGENT_GONE = (FileNotFoundError, EOFError, BrokenPipeError, ConnectionResetError)


def quiet_start_failure(exc_type, exc, tb) -> None:
    """``sys.excepthook`` of the fork server and the workers it forks (before their own code runs)."""
    del tb
    if isinstance(exc_type, type) and issubclass(exc_type, AGENT_GONE):
        return  # the agent is stopping and says so itself
    sys.stderr.write(f"moeckpt: a worker could not start: {getattr(exc_type, '__name__', exc_type)}: {exc}\n")
    sys.stderr.flush()


sys.excepthook = quiet_start_failure
