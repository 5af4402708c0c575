"""Process launching: ``torchrun`` for multi-process runs, and the worker entry point it starts.

``moeckpt train --nproc N`` (N > 1, not already under torchrun) re-executes itself as::

    python -m torch.distributed.run --standalone --nproc-per-node N -m moeckpt.trainer.launch train '<config JSON>'

torchrun's elastic agent gives every worker ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT`` (c10d rendezvous),
and each worker runs :func:`moeckpt.trainer.train.train` with the same config. Multi-node runs call torchrun
directly with the same module and arguments (``--nnodes``, ``--rdzv-endpoint`` ...): there is no launcher protocol
of our own. The config travels as JSON on the command line, never as serialised Python objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Sequence

import torch

from moeckpt.formats.errors import MoeckptError

__all__ = ["LaunchFailedError", "torchrun_command", "under_torchrun", "run_torchrun", "main"]

#: what the worker entry point can run.
JOBS = ("train", "eval")


class LaunchFailedError(MoeckptError, RuntimeError):
    """torchrun exited with an error (a worker failed); the workers' own messages are on stderr above."""

    exit_code = 1


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (the environment names its rank and world)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(job: str, config: dict[str, Any], nproc: int, *, extra: Sequence[str] = ()) -> list[str]:
    """The command line that starts ``nproc`` local workers running ``job`` (``train`` or ``eval``) on ``config``."""
    if job not in JOBS:
        raise ValueError(f"job={job!r} must be one of {JOBS}")
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra,
        "-m", "moeckpt.trainer.launch", job, json.dumps(config, separators=(",", ":")),
    ]


def run_torchrun(job: str, config: dict[str, Any], nproc: int, *, timeout_s: float | None = None,
                 capture_stdout: bool = False) -> str | None:
    """Run ``job`` in ``nproc`` local workers under torchrun and wait; raises :class:`LaunchFailedError`.

    With ``capture_stdout`` the workers' standard output is returned instead of printed (stderr passes through).
    """
    env = dict(os.environ)
    # Workers share the host's cores: without a cap each would start one thread per core and thrash.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.run(torchrun_command(job, config, nproc), env=env, timeout=timeout_s, check=False,
                          stdout=subprocess.PIPE if capture_stdout else None, text=True)
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
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
