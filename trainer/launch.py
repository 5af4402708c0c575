"""Process launching: ``torchrun`` for multi-process runs, and the worker entry point it starts.

``moeckpt train --nproc N`` (N > 1, not already under torchrun) re-executes itself as::

    python -m torch.distributed.run --standalone --nproc-per-node N -m moeckpt.trainer.launch train '<config JSON>'

torchrun's elastic agent gives every worker ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` (c10d rendezvous),
and each worker runs :func:`moeckpt.trainer.train.train` with the same config. The config travels as JSON on the
command line, never as serialised Python objects.

Elastic runs (``moeckpt train --nnodes MIN:MAX --rdzv-endpoint HOST:PORT`` on every node, :class:`Elastic`) start
torchrun with a c10d rendezvous instead of ``--standalone``: when a node dies the survivors' agent restarts its
workers in a smaller world, when a node joins the running agents restart theirs in a larger one, and every new
world resumes from the newest committed checkpoint, resharded at load (``docs/fault-tolerance.md``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeckpt.formats.errors import MoeckptError

__all__ = ["Elastic", "LaunchFailedError", "torchrun_command", "torchrun_env", "under_torchrun", "run_torchrun", "main"]

#: what the worker entry point can run.
JOBS = ("train", "eval")


class LaunchFailedError(MoeckptError, RuntimeError):
    """torchrun exited with an error (a worker failed); the workers' own messages are on stderr above."""

    exit_code = 1


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
        if m is None or int(m.group(1)) < 1 or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise ElasticSpecError(f"--nnodes {nnodes!r}: expected MIN:MAX with 1 <= MIN <= MAX (or one number N)")
        if not endpoint or not re.fullmatch(r"[^:\s]+:\d+", endpoint):
            raise ElasticSpecError(
                f"--rdzv-endpoint {endpoint!r}: expected HOST:PORT, the same on every node (the host keeps the "
                "rendezvous store)"
            )
        return cls(min_nodes=int(m.group(1)), max_nodes=int(m.group(2) or m.group(1)), endpoint=endpoint, **kwargs)

    def torchrun_args(self) -> list[str]:
        args = [
            f"--nnodes={self.min_nodes}:{self.max_nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}", f"--max-restarts={self.max_restarts}",
        ]
        return args + ([f"--rdzv-conf={self.conf}"] if self.conf else [])


class ElasticSpecError(MoeckptError, ValueError):
    """An ``--nnodes`` or ``--rdzv-endpoint`` value that cannot be parsed."""


def torchrun_command(job: str, config: dict[str, Any], nproc: int, *, elastic: Elastic | None = None,
                     extra: Sequence[str] = ()) -> list[str]:
    """The command line that starts ``nproc`` local workers running ``job`` (``train`` or ``eval``) on ``config``:
    a standalone single-node job, or one node of an elastic job."""
    if job not in JOBS:
        raise ValueError(f"job={job!r} must be one of {JOBS}")
    mode = elastic.torchrun_args() if elastic is not None else ["--standalone"]
    return [
        sys.executable, "-m", "torch.distributed.run", *mode, f"--nproc-per-node={nproc}", *extra,
        "-m", "moeckpt.trainer.launch", job, json.dumps(config, separators=(",", ":")),
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
    return env


def run_torchrun(job: str, config: dict[str, Any], nproc: int, *, elastic: Elastic | None = None,
                 timeout_s: float | None = None, capture_stdout: bool = False) -> str | None:
    """Run ``job`` in ``nproc`` local workers under torchrun and wait; raises :class:`LaunchFailedError`.

    With ``elastic`` this process is one node's agent of an elastic job. With ``capture_stdout`` the workers'
    standard output is returned instead of printed (stderr passes through).
    """
    proc = subprocess.run(torchrun_command(job, config, nproc, elastic=elastic), env=torchrun_env(nproc),
                          timeout=timeout_s, check=False, stdout=subprocess.PIPE if capture_stdout else None,
                          text=True)
    if proc.returncode:
        raise LaunchFailedError(f"torchrun with {nproc} workers running {job} exited with code {proc.returncode}")
    return proc.stdout if capture_stdout else None


def worker(job: str, config: dict[str, Any]) -> Any:
    """Run ``job`` on this rank (called in every torchrun worker)."""
    if not torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if job == "train":
        from .train import TrainConfig, train

        return train(TrainConfig.from_json(config))
    from .evaluate import EvalConfig, evaluate

    loss = evaluate(EvalConfig(**config))
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"loss": loss}), flush=True)
    return loss


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] not in JOBS:
        print(f"usage: python -m moeckpt.trainer.launch {{{'|'.join(JOBS)}}} CONFIG_JSON", file=sys.stderr)
        return 2
    try:
        worker(args[0], json.loads(args[1]))
    except MoeckptError as e:
        print(f"moeckpt: error (rank {os.environ.get('RANK', '0')}): {e}", file=sys.stderr)
        return e.exit_code
    finally:
        import gc

        import torch.distributed as dist

        # Free what garbage cycles still hold (a caught error's frames can reference process groups) while
        # torch.distributed is intact: left to interpreter shutdown, tearing down a gloo group can abort the
        # process ("terminate called without an active exception") after a run that succeeded.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
