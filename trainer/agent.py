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
  | "restart" | "node_joined" | "workers_stopped" | "rendezvous_done", "time": ...}``, wall clock): the
  failure detection, teardown and rendezvous phases of a restart, which the workers cannot see
  (:mod:`moeckpt.trainer.phases`);
* workers of moeckpt's own entry point (``-m moeckpt.trainer.launch JOB CONFIG``) are *forked from a warm
  server* instead of started as new interpreters: torch's agent runs the same entry point as a Python function
  (:func:`moeckpt.trainer.launch.forked_main`) with its ``forkserver`` start method, and the fork server,
  started as the agent starts, has imported torch and the trainer once (:data:`moeckpt.trainer.launch.WARM_MODULES`).
  A new world's workers, after a failure or a node joining, then start in milliseconds instead of seconds of
  imports (all of a node's workers at once on its cores). Everything else is torch's agent as before: the
  rendezvous, restarts, the signals passed on to the workers and the exit codes. ``--start-method`` given (or
  ``PET_START_METHOD``), another entry point, or ``MOECKPT_AGENT_FORKSERVER=0`` keeps torch's own way (a
  ``python`` subprocess per worker).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

#: the log record templates of torch's agent (torch 2.13) that become a line of ours; any other torch version
#: simply prints fewer lines.
_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
#: the same, of a worker forked from the warm server (a Python-function entry point).
_FAILED_FN = "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)"
_RESTART = "will restart worker group"
#: the records that end the agent's phases of a (re)start: the old workers stopped (the rendezvous begins), the
#: rendezvous done, the new workers being started.
_PHASE_RECORDS = {
    "[%s] Rendezvous'ing worker group": "workers_stopped",
    "[%s] Starting worker group": "rendezvous_done",
}


class _AgentLines(logging.Handler):
    """Turns torch's agent records into the few lines a user needs (or passes all through when verbose)."""

    def __init__(self, verbose: bool) -> None:
        super().__init__(logging.DEBUG)
        self.verbose = verbose

    def emit(self, record: logging.LogRecord) -> None:
        line = what = None
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()  # torchrun's records format positionally
        if self.verbose:
            line = f"torchrun: {record.getMessage()}"
        elif msg in (_FAILED, _FAILED_FN) and len(args) >= 3:
            code, local_rank, pid = args[:3]
            line = f"moeckpt: worker local rank {local_rank} (pid {pid}) exited with {_describe_exit(code)}"
            what = "worker_failed"
        elif _RESTART in msg and "attempts left" in msg and len(args) >= 4:
            left, most = args[2], args[3]
            line = (
                f"moeckpt: restarting the workers (restart {int(str(most)) - int(str(left)) + 1} of {most}); they resume "
                "from the newest committed checkpoint"
            )
            what = "restart"
        elif _RESTART in msg and "new nodes" in msg:
            line = "moeckpt: a node joined; restarting the workers in the larger world"
            what = "node_joined"
        elif msg in _PHASE_RECORDS:
            what = _PHASE_RECORDS[msg]  # the agent's phases of a (re)start, recorded only
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


#: the entry point whose workers the agent forks from its warm server.
_OUR_WORKER = ("-u", "-m", "moeckpt.trainer.launch")


def _warm_workers(argv: Sequence[str]) -> bool:
    """Whether to fork the workers from a warm server (see the module's doc)."""
    import multiprocessing

    if os.environ.get("MOECKPT_AGENT_FORKSERVER", "1") == "0" or os.environ.get("PET_START_METHOD"):
        return False
    if any(
        a in ("--start-method", "--start_method") or a.startswith(("--start-method=", "--start_method=")) for a in argv
    ):
        return False
    return "forkserver" in multiprocessing.get_all_start_methods()


def _use_warm_workers(run_module) -> None:
    """Make torch's ``run`` start moeckpt's worker entry point as a function forked from a warm fork server, and
    start that server now (it imports torch while the rendezvous waits for the other nodes)."""
    import multiprocessing
    import multiprocessing.forkserver

    from .launch import WARM_MODULES, forked_main

    original = run_module.config_from_args

    def config_from_args(args):
        config, cmd, cmd_args = original(args)
        if (
            isinstance(cmd, str)
            and os.path.realpath(cmd) == os.path.realpath(sys.executable)
            and tuple(cmd_args[:3]) == _OUR_WORKER
            and len(cmd_args) == 5
        ):
            config.start_method = "forkserver"
            return config, forked_main, list(cmd_args[3:])
        return config, cmd, cmd_args

    run_module.config_from_args = config_from_args
    _release_workers_at_shutdown()
    multiprocessing.set_forkserver_preload(list(WARM_MODULES))
    multiprocessing.forkserver.ensure_running()


def _release_workers_at_shutdown() -> None:
    """A forked worker whose function returned waits, before it exits, until the agent has read its return value
    (torch's ``_wrap``). At a shutdown (a signal passed on to the workers, a restart) the agent reads none: it
    only waits for them to exit, so a worker that saved on SIGTERM and returned sat there until the agent's
    ``--shutdown-timeout`` ran out and it was killed. The agent now releases them as the shutdown begins."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    original = MultiprocessContext._close

    def _close(self, death_sig, timeout: int = 30) -> None:
        finished = getattr(self, "_worker_finished_event", None)  # torch 2.x; another torch keeps its own way
        if finished is not None:
            finished.set()
        original(self, death_sig, timeout)

    MultiprocessContext._close = _close  # type: ignore[method-assign]


#: moeckpt's own ``--rdzv-conf`` keys (taken out before torch reads the rest), in seconds: ``poll_interval``, how
#: often a waiting agent looks at the rendezvous state (torch's c10d rendezvous: every second);
#: ``restart_last_call_timeout``, the last call of a round after a lost node or failed workers (torch's
#: ``last_call_timeout`` is then the first round's and a join's, when nodes must find each other).
OWN_KEYS = ("poll_interval", "restart_last_call_timeout")


def _take_own_keys(args) -> dict[str, float]:
    """Remove moeckpt's keys (:data:`OWN_KEYS`) from ``args.rdzv_conf`` and return their values."""
    conf = getattr(args, "rdzv_conf", "") or ""
    kept, own = [], {}
    for item in conf.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key in OWN_KEYS:
            try:
                own[key] = float(value)
            except ValueError:
                raise SystemExit(f"moeckpt: --rdzv-conf {key}={value!r}: expected seconds, e.g. 1") from None
            low = 0.01 if key == "poll_interval" else 0.0
            if not low <= own[key] <= 3600:
                raise SystemExit(f"moeckpt: --rdzv-conf {key}={value}: expected {low:g} to 3600 seconds")
        elif item:
            kept.append(item)
    args.rdzv_conf = ",".join(kept)
    return own


def _last_call_after_the_first_round(seconds: float, handler_class: Any = None) -> None:
    """Every rendezvous round after this agent's first that follows a lost node or failed workers gets a last
    call of ``seconds``: that long it waits for more survivors (a round closes at once when ``--nnodes``' maximum
    joined). A round that follows nodes asking to join keeps torch's ``last_call_timeout``, as the first round
    does: the joining node must see the new round open and enter it, and on a loaded machine that took longer than
    a survivor's short restart last call (the job then restarted once more to take it in). ``handler_class`` is
    torch's ``DynamicRendezvousHandler`` (a stand-in in tests)."""
    from datetime import timedelta

    if handler_class is None:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

        handler_class = DynamicRendezvousHandler
    original_next, original_waiting = handler_class.next_rendezvous, handler_class.num_nodes_waiting

    def num_nodes_waiting(self) -> int:
        # torch's agent asks this only while its workers are healthy, and restarts them when it is not 0
        waiting = original_waiting(self)
        if waiting > 0:
            self._moeckpt_nodes_joining = True
        return waiting

    def next_rendezvous(self):
        timeout = getattr(getattr(self, "_settings", None), "timeout", None)
        if timeout is not None and hasattr(timeout, "_last_call"):  # torch 2.x; another torch keeps its own
            first = self.__dict__.get("_moeckpt_first_last_call")
            if first is None:  # this agent's first round: torch's last call, kept for the joins after it
                self._moeckpt_first_last_call = timeout._last_call
            else:
                joining = self.__dict__.pop("_moeckpt_nodes_joining", False)
                timeout._last_call = first if joining else timedelta(seconds=seconds)
        return original_next(self)

    handler_class.next_rendezvous = next_rendezvous
    handler_class.num_nodes_waiting = num_nodes_waiting


def _poll_rendezvous_every(poll: float) -> None:
    """torch's c10d rendezvous looks at the shared state once a second while it waits (for a dead node's heartbeat
    to expire, for the last call to end): it sleeps 1 s between looks, and serves a look from its copy of the
    state while that is less than 1 s old (a dead node is found only on a fresh read). A restart so takes up to
    whole seconds more than its timeouts. Make both ``poll`` seconds (each look then reads the state from the
    store: keep it near 1 s for many nodes)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous, utils

    original = utils._delay

    def delay(seconds: float | tuple[float, float]) -> None:  # torch calls it with seconds=...
        original(poll if seconds == 1 else seconds)  # the state poll; the first round's random skew stays

    dynamic_rendezvous._delay = delay
    holder = getattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", None)
    if holder is not None:
        init = holder.__init__

        def __init__(self, backend, settings, cache_duration=1) -> None:
            init(self, backend, settings, cache_duration=min(cache_duration, poll))

        holder.__init__ = __init__


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
        # torch.multiprocessing's records ("Terminating process ... via signal SIGTERM") are the agent's too, with
        # workers forked from the warm server.
        import torch.multiprocessing.spawn  # noqa: F401 - its logger exists before the handlers are replaced

        ours = ("torch.distributed.", "torch.multiprocessing.")
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger) and (name + ".").startswith(ours):
                for h in list(lg.handlers):
                    lg.removeHandler(h)
                lg.propagate = True
        lines = _AgentLines(verbose)
        for top in ("torch.distributed", "torch.multiprocessing"):
            agent_logs = logging.getLogger(top)
            agent_logs.addHandler(lines)
            agent_logs.propagate = False
        argv = list(sys.argv[1:] if argv is None else argv)
        args = parse_args(argv)
        own = _take_own_keys(args)
        if "poll_interval" in own:
            _poll_rendezvous_every(own["poll_interval"])
        if "restart_last_call_timeout" in own:
            _last_call_after_the_first_round(own["restart_last_call_timeout"])
        if _warm_workers(argv):
            import torch.distributed.run as run_module

            _use_warm_workers(run_module)
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
                f"moeckpt: the workers failed and no restart is left (--max-restarts {args.max_restarts}){first}\n"
            )
            return 1
    except _Stopped as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


if __name__ == "__main__":
    sys.exit(main())
