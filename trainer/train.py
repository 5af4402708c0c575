"""The training loop: a model shard per rank, ZeRO-1 AdamW, checkpoints through moeckpt, automatic resume.

One process per rank (torchrun, or :func:`moeckpt.trainer.local_world.run_local_world` in tests); each calls
:func:`train` with the same :class:`TrainConfig`. The layout is ``(tp, ep, dp = world / tp)``. A run directory holds
``step-XXXXXXXX`` checkpoints and ``metrics.jsonl``; starting :func:`train` on a run directory that already has a
committed checkpoint continues from the newest one, in whatever layout this invocation has (load-time resharding).

Everything that decides the numbers is a function of the config and the step, never of the layout: the initial
weights (``(seed, tensor name)``, as ``moeckpt init``), the samples of each step (a global sample counter), the
learning rate (a pure function of the step). So the same run in another layout gives the same losses up to
floating-point reduction order, and a resume in the same layout continues bit for bit.

The parts: :mod:`.preflight` (what is refused before allocating), :mod:`.build` (a rank's state, step by step),
:mod:`.resume_run` (where a start's state comes from), :mod:`.step_loop` (the :class:`Trainer` and its steps);
this module joins the world and runs one invocation (:func:`run_training`), and keeps the names callers import
from it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import RESUME_READS, TrainConfig
from .parallel import init_from_env
from .phases import process_start_time
from .preemption import PreemptionFlag
from .preflight import DTYPES, check_launch, check_run_dir, check_shape, open_dataset, run_model
from .resume_run import NonFiniteLossError
from .step_loop import Trainer

__all__ = [
    "DTYPES",
    "RESUME_READS",
    "NonFiniteLossError",
    "RunSummary",
    "TrainConfig",
    "Trainer",
    "check_launch",
    "check_run_dir",
    "check_shape",
    "open_dataset",
    "run_model",
    "run_training",
    "setup_world",
    "train",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSummary:
    """What one invocation of :func:`run_training` did on this rank."""

    #: the metrics records of the steps this invocation trained (this rank's view).
    records: list[dict[str, Any]]
    #: the run's step when the invocation ended.
    step: int
    #: whether a SIGTERM stopped it (its step saved).
    preempted: bool = False


def setup_world(config: TrainConfig) -> torch.device:
    """Join the torchrun world when the environment has one (or reuse an initialized one); the device to use."""
    if dist.is_initialized() or "RANK" in os.environ:
        device = init_from_env(backend=config.backend)
    else:
        from .parallel import default_device

        device = default_device()
    return torch.device("cpu") if config.cpu else device


def train(config: TrainConfig) -> list[dict[str, Any]]:
    """Run (or continue) training on this rank; every rank of the world calls it. Returns this rank's records."""
    return run_training(config).records


def run_training(config: TrainConfig) -> RunSummary:
    """:func:`train`, returning what the invocation did: its records, the step it ended at, and whether a SIGTERM
    stopped it (every rank of the world calls it)."""
    marks = {"process_start": process_start_time(), "entered": time.time()}
    device = setup_world(config)
    marks["world_joined"] = time.time()
    trainer = Trainer(config, device=device, marks=marks)
    preempted = PreemptionFlag()  # SIGTERM: save at the next step boundary, then exit 0
    # Its own CPU group: the checkpoint group is busy with background saves, and the training group may be NCCL.
    control = dist.new_group(backend="gloo") if dist.is_initialized() else None
    try:
        records = trainer.run(should_stop=lambda: preempted.agreed(control))
        if trainer.memory is not None and not trainer.stopped_early:
            # the invocation ended normally, its last step persisted: the memory tier has nothing more to give.
            # Stopped by SIGTERM (the agent re-forming the world, a preemption) it stays for the next world.
            trainer.memory.remove_all()
        if trainer.stopped_early and trainer.rank == 0:
            log.info(
                "stopped on SIGTERM at step %d%s",
                trainer.step,
                ", its checkpoint committed" if records else " before training a step: nothing new to save",
            )
        return RunSummary(records=records, step=trainer.step, preempted=trainer.stopped_early)
    finally:
        preempted.restore()
        trainer.close()
