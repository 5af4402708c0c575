"""torchrun's elastic agent, run quietly: ``python -m moeckpt.trainer.agent TORCHRUN_ARGS...``.

This is torchrun (``torch.distributed.run``) itself, its arguments unchanged; it only changes what reaches the
terminal and what happens around the edges:

* its log records become at most one line per event that a user must know about (a worker failed, the workers
  restart, a node joined); everything else, and the tracebacks torchrun prints when it is stopped by a signal or
  gives up on failed workers, is left out (``MOECKPT_AGENT_VERBOSE=1``, what ``moeckpt -vv`` sets, keeps all of
  torch's records);
* stopped by SIGINT, SIGTERM or SIGHUP it exits ``128 + signal`` after torch's agent has passed the signal on to
  the workers and waited for them (``--shutdown-timeout``), and with code 1 and one line when the workers
  failed more often than ``--max-restarts`` allows;
* on Linux it dies with its parent (the ``moeckpt`` launcher), so a launcher killed outright leaves no agent
  behind; the agent's own shutdown then stops the workers;
* with ``MOECKPT_AGENT_EVENTS=PATH`` it appends one JSON line per such event to PATH (``{"what": "worker_failed"
  | "restart" | "node_joined", "time": ...}``, wall clock): the failure detection and teardown phases of a
  restart, which the workers cannot see (:mod:`moeckpt.trainer.phases`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: the log record templates of torch's agent (torch 2.13) that become a line of ours; any other torch version
#: simply prints fewer lines.
_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
_RESTART = "will restart worker group"


class _AgentLines(logging.Handler):
    """Turns torch's agent records into the few lines a user needs (or passes all through when verbose)."""

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.DEBUG)
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        line = what = None
        msg = str(record.msg)
        if self.verbose:
            line = f"torchrun: {record.getMessage()}"
        elif msg == _FAILED and len(record.args or ()) >= 3:
            code, local_rank, pid = record.args[:3]  # type: ignore[index]
            line = f"moeckpt: worker local rank {local_rank} (pid {pid}) exited with {_describe_exit(code)}"
            what = "worker_failed"
        elif _RESTART in msg and "attempts left" in msg and len(record.args or ()) >= 4:
            left, most = record.args[2], record.args[3]  # type: ignore[index]
            line = (f"moeckpt: restarting the workers (restart {int(most) - int(left) + 1} of {most}); they resume "
                    "from the newest committed checkpoint")
            what = "restart"
        elif _RESTART in msg and "new nodes" in msg:
            line = "moeckpt: a node joined; restarting the workers in the larger world"
            what = "node_joined"
        if what is not None:
            _record_event(what, record.created)
        if line is not None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()


def _record_event(what: str, when: float) -> None:
    path = os.environ.get("MOECKPT_AGENT_EVENTS")
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "time": when, "pid": os.getpid()}) + "\n")
    except OSError:
        pass  # a diagnostic only: never stop the agent for it


def _describe_exit(code) -> str:
    try:
        code = int(code)
    except (TypeError, ValueError):
        return f"code {code}"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    if code == 124:
        return "code 124 (its hang watchdog fired)"
    return f"code {code}"


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the launcher that started us dies, whatever killed it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher was already gone before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _Stopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    del frame
    raise _Stopped(signum)


def main(argv: Sequence[str] | None = None) -> int:
    # Until torch's agent installs its own handlers (when it starts the workers), a signal just ends us quietly.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _stop)
    try:
        _die_with_parent()
        verbose = os.environ.get("MOECKPT_AGENT_VERBOSE") == "1"
        # torch's agent loggers take their level from LOGLEVEL when they are created (at import); the workers
        # must not inherit it.
        os.environ["LOGLEVEL"] = "INFO"
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        del os.environ["LOGLEVEL"]
        # torch._logging gives "torch.distributed" and some loggers below it handlers of their own: ours replaces
        # them, and every record of the agent (run, launcher, elastic, rendezvous) ends there.
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger) and (name + ".").startswith("torch.distributed."):
                for h in list(lg.handlers):
                    lg.removeHandler(h)
                lg.propagate = True
        agent_logs = logging.getLogger("torch.distributed")
        agent_logs.addHandler(_AgentLines(verbose))
        agent_logs.propagate = False
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
        try:
            run(args)
        except SignalException as e:
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            try:
                rank, failure = e.get_first_failure()
                first = f": rank {rank} exited first, with {_describe_exit(failure.exitcode)}"
            except (ValueError, AttributeError, KeyError):
                first = ""
            sys.stderr.write(
                f"moeckpt: the workers failed and no restart is left (--max-restarts {args.max_restarts}){first}\n")
            return 1
    except _Stopped as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
