"""Process launching: ``torchrun`` for multi-process runs, and the worker entry point it starts.

``moeckpt train --nproc N`` (N > 1, not already under torchrun) starts torchrun's elastic agent::

    python -m moeckpt.trainer.agent --standalone --max-restarts R --nproc-per-node N \\
        -m moeckpt.trainer.launch train '<config JSON>'

(:mod:`moeckpt.trainer.agent` is ``torch.distributed.run`` with quieter output). The agent gives every worker
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` (c10d rendezvous), and each worker runs
:func:`moeckpt.trainer.train.train` with the same config. The config travels as JSON on the command line, never as
serialised Python objects. A worker that fails or hangs (its watchdog ends it) makes the agent restart all of them,
up to ``max_restarts`` times; each new world resumes from the newest committed checkpoint.

Elastic runs (``moeckpt train --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` on every node, :class:`Elastic`) start
the agent with a c10d rendezvous instead of ``--standalone``: when a node dies the survivors' agent restarts its
workers in a smaller world, when a node joins the running agents restart theirs in a larger one, and every new
world resumes from the newest committed checkpoint, resharded at load (``docs/fault-tolerance.md``).

The launcher supervises the agent (:func:`moeckpt.trainer.supervise.supervise`): SIGINT, SIGTERM or SIGHUP stop
the whole job and no worker outlives it. Each worker leaves a small JSON status (how it ended, at which step) in a
directory the launcher names in ``MOECKPT_STATUS_DIR``, so the launcher can tell a SIGTERM that was saved from
one that was not, and report the step the run reached.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from moeckpt.formats.errors import MoeckptError

__all__ = [
    "Elastic",
    "JobInterruptedError",
    "JobResult",
    "LaunchFailedError",
    "torchrun_command",
    "torchrun_env",
    "under_torchrun",
    "run_torchrun",
    "main",
]

#: what the worker entry point can run.
JOBS = ("train", "eval")
#: the environment variable naming the directory where each worker leaves its status (``rank<R>.json``).
STATUS_ENV = "MOECKPT_STATUS_DIR"
#: the environment variable carrying the launcher's log level to the workers (``DEBUG``, ``INFO``, ``WARNING``).
LOG_LEVEL_ENV = "MOECKPT_LOG_LEVEL"
#: the most nodes an elastic job may have (``--nnodes``).
MAX_NODES = 4096
#: seconds torch's agent waits for workers to stop after passing them a signal (a SIGTERM save included)
#: before it kills them.
SHUTDOWN_TIMEOUT_S = 120


def agent_options() -> frozenset[str]:
    """The options this torch's elastic agent (``torch.distributed.run``) accepts: torch adds some over releases
    (``--shutdown-timeout`` is newer than torch 2.11), and the agent refuses any it does not know."""
    global _AGENT_OPTIONS
    if _AGENT_OPTIONS is None:
        from torch.distributed.run import get_args_parser

        _AGENT_OPTIONS = frozenset(o for a in get_args_parser()._actions for o in a.option_strings)
    return _AGENT_OPTIONS


_AGENT_OPTIONS: frozenset[str] | None = None


def shutdown_args(options: frozenset[str] | None = None) -> list[str]:
    """``--shutdown-timeout`` where the agent has it; an older agent kills its workers after its own default."""
    return [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"] if "--shutdown-timeout" in (options or agent_options()) else []


class LaunchFailedError(MoeckptError, RuntimeError):
    """torchrun exited with an error (a worker failed); the workers' own messages are on stderr above."""

    exit_code = 1


class JobInterruptedError(MoeckptError, RuntimeError):
    """The launcher was stopped by a signal and stopped its workers; exit code ``128 + signal``."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (the environment names its rank and world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Elastic:
    """torchrun's elastic mode: this node is one of ``min_nodes``..``max_nodes`` agents meeting at ``endpoint``.

    The agent on the host named by ``endpoint`` keeps the rendezvous store: it must outlive the others (or point
    ``endpoint`` at a store that outlives every training node). ``conf`` is passed to ``--rdzv-conf`` verbatim
    (``last_call_timeout=5,keep_alive_interval=2,...``).
    """

    min_nodes: int
    max_nodes: int
    endpoint: str
    run_id: str = "moeckpt"
    max_restarts: int = 3
    conf: str = ""

    @classmethod
    def parse(cls, nnodes: str, endpoint: str | None, **kwargs: Any) -> Elastic:
        """From ``--nnodes MIN:MAX`` (or ``N``) and ``--rdzv-endpoint HOST:PORT``; raises :class:`LaunchFailedError`
        with exit code 2 on a malformed value."""
        m = re.fullmatch(r"(\d+)(?::(\d+))?", nnodes.strip())
        if (
            m is None
            or int(m.group(1)) < 1
            or int(m.group(2) or m.group(1)) < int(m.group(1))
            or int(m.group(2) or m.group(1)) > MAX_NODES
        ):
            raise ElasticSpecError(
                f"--nnodes {nnodes!r}: expected MIN:MAX with 1 <= MIN <= MAX <= {MAX_NODES} (or one number N)"
            )
        port_ok = bool(
            endpoint and re.fullmatch(r"[^:\s]+:\d+", endpoint) and 0 < int(endpoint.rsplit(":", 1)[1]) < 65536
        )
        if endpoint is None or not port_ok:
            raise ElasticSpecError(
                f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT (port 1-65535), the same on every node (the host "
                "keeps the rendezvous store)"
            )
        return cls(min_nodes=int(m.group(1)), max_nodes=int(m.group(2) or m.group(1)), endpoint=endpoint, **kwargs)

    def torchrun_args(self) -> list[str]:
        args = [
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--max-restarts={self.max_restarts}",
        ]
        return args + ([f"--rdzv-conf={self.conf}"] if self.conf else [])


class ElasticSpecError(MoeckptError, ValueError):
    """An ``--nnodes`` or ``--rdzv-endpoint`` value that cannot be parsed."""


def torchrun_command(
    job: str,
    config: dict[str, Any],
    nproc: int,
    *,
    elastic: Elastic | None = None,
    max_restarts: int = 0,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line that starts ``nproc`` local workers running ``job`` (``train`` or ``eval``) on ``config``:
    a standalone single-node job (restarting its workers up to ``max_restarts`` times), or one node of an elastic
    job (its own ``max_restarts``)."""
    if job not in JOBS:
        raise ValueError(f"job={job!r} must be one of {JOBS}")
    mode = elastic.torchrun_args() if elastic is not None else ["--standalone", f"--max-restarts={max_restarts}"]
    return [
        sys.executable,
        "-m",
        "moeckpt.trainer.agent",
        *mode,
        f"--nproc-per-node={nproc}",
        *shutdown_args(),
        *extra,
        "-m",
        "moeckpt.trainer.launch",
        job,
        json.dumps(config, separators=(",", ":")),
    ]


def torchrun_env(nproc: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for torchrun and its workers."""
    env = dict(os.environ if base is None else base)
    # Workers share the host's cores: without a cap each would start one thread per core and thrash.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # By default the c10d rendezvous hands its workers one TCP store for the life of the agent, and
    # workers of a new round find the previous round's keys in it: gloo then connects to the dead world's ports
    # ("Connection refused") and every re-rendezvous after a node loss fails. Opting out gives each round a fresh
    # store hosted by its rank-0 worker. (torch 2.13; see docs/fault-tolerance.md.)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # c10's C++ warnings (a TCPStore connect interrupted by the Ctrl-C that stops the job prints 30 lines of C++
    # frames) are not for the terminal; TORCH_CPP_LOG_LEVEL=WARNING brings them back.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


@dataclass(frozen=True)
class JobResult:
    """How a launched job ended: the signal that stopped it (if one did) and each local worker's last status."""

    nproc: int
    signal: int | None = None
    #: ``{global rank: status}`` of this node's workers (see :func:`write_status`); a worker that was killed
    #: before it could report is missing.
    statuses: dict[int, dict[str, Any]] = field(default_factory=dict)

    def rank0(self) -> dict[str, Any] | None:
        return self.statuses.get(0)

    def all_preempted(self) -> bool:
        """Whether every local worker stopped through the SIGTERM path, its step saved (or nothing to save)."""
        return len(self.statuses) == self.nproc and all(s.get("outcome") == "preempted" for s in self.statuses.values())


def run_torchrun(
    job: str, config: dict[str, Any], nproc: int, *, elastic: Elastic | None = None, max_restarts: int = 0
) -> JobResult:
    """Run ``job`` in ``nproc`` local workers under torchrun's agent, supervised, and wait.

    Raises :class:`LaunchFailedError` when the workers failed (past their restarts) and
    :class:`JobInterruptedError` when a signal stopped the job, except a SIGTERM to ``train``: that returns, with
    :attr:`JobResult.signal` set, so the caller can tell whether the workers saved first.
    """
    from .supervise import supervise

    with tempfile.TemporaryDirectory(prefix="moeckpt-status-") as status_dir:
        env = torchrun_env(nproc)
        env[STATUS_ENV] = status_dir
        # torchrun's own log directory too, so that nothing of the job stays in the temporary directory
        cmd = torchrun_command(
            job,
            config,
            nproc,
            elastic=elastic,
            max_restarts=max_restarts,
            extra=["--log-dir", os.path.join(status_dir, "torchelastic")],
        )
        outcome = supervise(cmd, env=env)
        result = JobResult(nproc=nproc, signal=outcome.signal, statuses=read_statuses(status_dir))
    if outcome.signal is not None and (outcome.signal != signal.SIGTERM or job != "train"):
        name = signal.Signals(outcome.signal).name
        raise JobInterruptedError(f"interrupted ({name}): stopped the {nproc} {job} workers", outcome.signal)
    if outcome.signal is None and outcome.returncode:
        raise LaunchFailedError(
            f"the {nproc} {job} workers failed (torchrun's agent exited with code {outcome.returncode}); "
            "their messages are above"
        )
    return result


def write_status(status: dict[str, Any]) -> None:
    """Leave this worker's status for the launcher (no-op outside a launch by :func:`run_torchrun`)."""
    where = os.environ.get(STATUS_ENV)
    if not where or not os.path.isdir(where):
        return
    path = os.path.join(where, f"rank{os.environ.get('RANK', '0')}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def read_statuses(where: str) -> dict[int, dict[str, Any]]:
    out = {}
    for name in os.listdir(where):
        m = re.fullmatch(r"rank(\d+)\.json", name)
        if m:
            try:
                with open(os.path.join(where, name)) as f:
                    out[int(m.group(1))] = json.load(f)
            except (OSError, ValueError):
                continue
    return out


def worker(job: str, config: dict[str, Any]) -> dict[str, Any]:
    """Run ``job`` on this rank (called in every torchrun worker); returns its status for the launcher."""
    import torch

    if not torch.cuda.is_available():
        from moeckpt.reshard.runtime import cores_per_rank

        torch.set_num_threads(cores_per_rank())
    if job == "train":
        from .train import TrainConfig, run_training

        summary = run_training(TrainConfig.from_json(config))
        return {
            "outcome": "preempted" if summary.preempted else "done",
            "step": summary.step,
            "steps_trained": len(summary.records),
            "last": summary.records[-1] if summary.records else None,
        }
    from tqdm import tqdm

    from .evaluate import EvalConfig, evaluate

    cfg = EvalConfig(**config)
    # Rank 0 shows the terminal a bar (tqdm draws nothing when stderr is not a terminal).
    with tqdm(
        total=cfg.batches,
        desc="eval",
        unit="batch",
        file=sys.stderr,
        leave=False,
        disable=True if os.environ.get("RANK", "0") != "0" else None,
    ) as bar:
        return {"outcome": "done", "loss": evaluate(cfg, on_batch=lambda: bar.update(1))}


def _peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another worker is gone (the echo of that worker's failure)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(
        s in text
        for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        from .preemption import listen_early

        listen_early()  # a SIGTERM from now on is a preemption notice, even before the training loop listens
    rank = os.environ.get("RANK", "0")
    from .logs import configure_logging, logger

    configure_logging(os.environ.get(LOG_LEVEL_ENV, "INFO"))
    log = logger("moeckpt.trainer.launch")  # not __name__: run as a module, that is "__main__"
    if len(args) != 2 or args[0] not in JOBS:
        log.error("usage: python -m moeckpt.trainer.launch {%s} CONFIG_JSON", "|".join(JOBS))
        return 2
    code = 0
    try:
        write_status(worker(args[0], json.loads(args[1])))
    except MoeckptError as e:
        # A save or load that failed because another worker died is the echo of that worker's failure, which
        # the agent reports; only the root cause reaches the terminal.
        (log.debug if _peer_lost(e) else log.error)("(rank %s) %s", rank, e)
        code = e.exit_code
    except KeyboardInterrupt:
        write_status({"outcome": "interrupted"})
        code = 128 + signal.SIGINT
    except Exception as e:
        if not _peer_lost(e):
            raise
        # Another worker died or was stopped and took the collective with it; its own report says why.
        log.debug("(rank %s) a collective failed because a peer is gone: %s", rank, " ".join(str(e).split())[:300])
        code = 1
    finally:
        _tear_down()
    return code


#: what the agent's fork server imports once, so that a worker forked from it after a restart (or at the first
#: start) pays no interpreter start and no torch import (:mod:`moeckpt.trainer.agent`).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "moeckpt.trainer.launch",
    "moeckpt.trainer.train",
    "moeckpt.formats.storages.local",
    "moeckpt.trainer.models.zaya.model",
    "moeckpt.trainer.models.qwen3_moe.model",
    "moeckpt.trainer.models.deepseek_v3.model",
    "moeckpt.trainer.warm_server",
)


def forked_main(job: str, config_json: str) -> None:
    """The worker entry point when the agent forks its workers from its warm fork server instead of starting
    ``python -u -m moeckpt.trainer.launch JOB CONFIG``: the same :func:`main`, its exit code the process's."""
    for stream in (sys.stdout, sys.stderr):  # as ``python -u``: nothing waits in a buffer for the exit
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(write_through=True, line_buffering=True)
    code = main([job, config_json])
    if code:
        sys.exit(code)


def _tear_down() -> None:
    """Free what garbage cycles still hold (a caught error's frames can reference process groups) while
    torch.distributed is intact: left to interpreter shutdown, tearing down a gloo group can abort the process
    ("terminate called without an active exception") after a run that succeeded. Nothing to do when torch was
    never (fully) imported: importing it again after a Ctrl-C cut its first import short aborts the process."""
    import gc

    dist = sys.modules.get("torch.distributed")
    gc.collect()
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a half-imported or broken torch: the process ends anyway
        pass


if __name__ == "__main__":
    sys.exit(main())
