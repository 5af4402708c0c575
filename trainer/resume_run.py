"""Where a rank's state comes from when a run (re)starts, and where it goes back to after a NaN: the trainer's
resume order, as a part of :class:`~moeckpt.trainer.step_loop.Trainer`.

A start takes the newest memory checkpoint the nodes of this world hold (when the memory tier is on and it is not
older than the newest persisted step), else the newest committed checkpoint of the run directory that reads back
intact (a damaged one is set aside and the previous one tried), else it is fresh: layout-free initial weights, or
``--init-from``'s. A NaN/Inf loss rolls back to the newest intact checkpoint, keeping the data position.
Loading one checkpoint into the live model and optimizer, resharded, is :mod:`.resume`'s.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps, quarantine
from moeckpt.formats.errors import MoeckptError
from moeckpt.reshard import collectives
from moeckpt.reshard.state_dict_checkpoints import is_state_dict

from .build import init_weights
from .memory_restore import restore_newest
from .resume import DAMAGED_CHECKPOINT_ERRORS, Restored, ResumeError, restore, restore_from_state_dict

if TYPE_CHECKING:
    from moeckpt.formats.index import TensorEntry

    from .checkpointing import CheckpointManager
    from .config import TrainConfig
    from .data import BatchLoader
    from .memory_tier import MemoryTier
    from .metrics import MetricsLog
    from .models import ModelSpec
    from .parallel import ParallelGroups
    from .schedule import LRSchedule

__all__ = ["NonFiniteLossError", "ResumeSteps"]

log = logging.getLogger(__name__)


class NonFiniteLossError(MoeckptError, FloatingPointError):
    """The loss became NaN or infinite; the run stops without saving the broken state."""

    exit_code = 1


class ResumeSteps:
    """The resume and rollback steps of a :class:`~moeckpt.trainer.step_loop.Trainer` (built first, see
    :mod:`.build`): every method is collective over the checkpoint manager's group."""

    config: TrainConfig
    spec: ModelSpec
    groups: ParallelGroups
    rank: int
    optimizer: Any
    schedule: LRSchedule
    loader: BatchLoader
    tensors: dict[str, TensorEntry]
    checkpoints: CheckpointManager
    metrics: MetricsLog
    memory: MemoryTier | None
    step: int
    nan_rollbacks: int
    resumed_from: str | None
    resume_tier: str | None
    _params: Any

    def _resume(self) -> None:
        restored = self._restore_newest_intact()
        if restored is None:
            # Only a fresh start needs the layout-free initial values: a resume overwrites every tensor they set,
            # and making them (one full tensor of every parameter, on the CPU) took seconds of each restart.
            init_weights(self.optimizer, self.spec, self._params, seed=self.config.seed)
            if self.config.init_from:
                self._start_from(self.config.init_from)
            return
        state = restored.train_state
        self.step = int(state.get("step", restored.step))
        if "data" in state:
            self.loader.load_state_dict(state["data"])
        else:
            self.loader.consumed_samples = self.step * self.config.global_batch
        self.schedule.steps = int(state.get("schedule", {}).get("steps", self.step))
        self.resumed_from = restored.location
        self.resume_stats = restored.stats
        everyone = collectives.all_gather_json(
            [restored.stats.bytes_read, restored.stats.bytes_needed, restored.stats.seconds], self.checkpoints.group
        )
        read = sum(r[0] for r in everyone)
        self.metrics.write(
            {
                "event": "resume",
                "step": self.step,
                "tier": self.resume_tier,
                "memory_bytes_read": read if self.resume_tier == "memory" else 0,
                "storage_bytes_read": read if self.resume_tier == "storage" else 0,
                "from_layout": restored.source_layout.to_json(),
                "to_layout": self.groups.layout.to_json(),
                # storage reads of all ranks against the bytes the new layout holds (replicas counted once per rank)
                "bytes_read": sum(r[0] for r in everyone),
                "bytes_needed": sum(r[1] for r in everyone),
                "state_bytes": sum(e.nbytes for e in self.tensors.values()),
                "exchanged": restored.exchanged,
                "time": time.time(),
                "seconds": max(r[2] for r in everyone),
                "optimizer_reset": restored.optimizer_reset,
            }
        )
        if self.rank == 0:
            st = restored.stats
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
            why = f" after restart {restart} of the workers" if restart else ""
            fresh = (
                f"; its optimizer state is not {self.optimizer.name}'s: started fresh"
                if restored.optimizer_reset
                else ""
            )
            log.info(
                "resumed from %s %s (step %d, written in layout %s) into layout %s%s: rank 0 read %.2f MB for %.2f "
                "MB of state in %.2f s%s",
                "host memory" if self.resume_tier == "memory" else "storage",
                restored.location,
                self.step,
                restored.source_layout,
                self.groups.layout,
                why,
                st.bytes_read / 1e6,
                st.bytes_needed / 1e6,
                st.seconds,
                fresh,
            )
            if restored.source_layout != self.groups.layout:
                log.info("layout change: %s -> %s (resharded at load)", restored.source_layout, self.groups.layout)

    def _start_from(self, location: str) -> None:
        """Load ``init_from``'s parameters and optimizer state (resharded, collective); the run starts at step 0."""
        if is_state_dict(CheckpointReader(location).index):  # another trainer's state dict under our model's names
            restored = restore_from_state_dict(location, self.optimizer, self.spec, group=self.checkpoints.group)
        else:
            restored = restore(
                location,
                self.optimizer,
                model_json=self.spec.to_json(),
                group=self.checkpoints.group,
                reads=self.config.resume_reads,
                reset_optimizer=self.config.reset_optimizer,
            )
        self.metrics.write(
            {
                "event": "init_from",
                "location": restored.location,
                "checkpoint_step": restored.step,
                "from_layout": restored.source_layout.to_json(),
                "to_layout": self.groups.layout.to_json(),
                "time": time.time(),
            }
        )
        if self.rank == 0:
            st = restored.stats
            log.info(
                "starting from %s (its step %d, layout %s) in layout %s: rank 0 read %.2f MB in %.2f s",
                restored.location,
                restored.step,
                restored.source_layout,
                self.groups.layout,
                st.bytes_read / 1e6,
                st.seconds,
            )

    def _restore_newest_intact(self) -> Restored | None:
        """Load the newest committed checkpoint that reads back intact (collective); ``None`` for a fresh run.

        A damaged one (a checksum mismatch, a truncated file) is set aside and the previous one tried, so a
        corrupted file costs the steps since the checkpoint before it, not the run.
        """
        # Rank 0 decides, so every rank loads the same step even if a listing (S3) differs between ranks.
        candidates = collectives.broadcast_json(
            [[step, st.location] for step, st in reversed(committed_steps(self.config.run_dir))]
            if self.rank == 0
            else None,
            0,
            self.checkpoints.group,
        )
        if self.memory is not None:
            restored = self._restore_from_memory(not_before=candidates[0][0] if candidates else None)
            if restored is not None:
                self.resume_tier = "memory"
                return restored
        for step, location in candidates:
            try:
                restored = restore(
                    location,
                    self.optimizer,
                    model_json=self.spec.to_json(),
                    group=self.checkpoints.group,
                    reads=self.config.resume_reads,
                    reset_optimizer=self.config.reset_optimizer,
                )
                self.resume_tier = "storage"  # only a resume has a tier: a fresh start prints no restart phases
                return restored
            except DAMAGED_CHECKPOINT_ERRORS as e:
                # Every rank gets the same error class from a collective load, so all of them fall back together.
                self._set_aside_damaged(step, location, e)
        if candidates:
            raise ResumeError(
                f"{self.config.run_dir}: all {len(candidates)} committed checkpoints are damaged (see the "
                "'damaged_checkpoint' events in metrics.jsonl); restore one from a copy or start a new --run-dir"
            )
        return None

    def _restore_from_memory(self, *, not_before: int | None) -> Restored | None:
        """Load the newest memory checkpoint the nodes of this world hold between them, if it is not older than
        the newest persisted step (collective); ``None`` when there is none left (the fallback order, a damaged
        copy set aside at each turn, is :func:`~moeckpt.trainer.memory_restore.restore_newest`'s).

        Each writer's file is read by a rank whose node holds it and exchanged over the checkpoint group, so a
        node that holds none of it (a new node) still loads; it gets the step's index to plan with."""
        if self.memory is None:
            return None

        def load(location: str, readable) -> Restored:
            return restore(
                location,
                self.optimizer,
                model_json=self.spec.to_json(),
                group=self.checkpoints.group,
                reset_optimizer=self.config.reset_optimizer,
                readable=readable,
            )

        def rejected(step: int, error: str, problems: dict[str, list[str]]) -> None:
            self.metrics.write(
                {
                    "event": "damaged_checkpoint",
                    "tier": "memory",
                    "step": step,
                    "error": error,
                    "nodes": problems,
                    "time": time.time(),
                }
            )

        return restore_newest(
            self.memory, load, not_before=not_before, group=self.checkpoints.group, on_rejected=rejected
        )

    def _set_aside_damaged(self, step: int, location: str, error: Exception) -> None:
        """Resume found ``location`` damaged: record it, move it out of the way (rank 0) and let the caller try the
        previous checkpoint. Collective, so no rank lists the run directory before the move is done."""
        moved = None
        if self.rank == 0:
            moved = quarantine(location)
            log.warning(
                "checkpoint of step %d is damaged (%s); moved it to %s and resuming from the previous one",
                step,
                error,
                moved,
            )
            self.metrics.write(
                {
                    "event": "damaged_checkpoint",
                    "step": step,
                    "error": str(error),
                    "moved_to": moved,
                    "time": time.time(),
                }
            )
        collectives.broadcast_json(moved, 0, self.checkpoints.group)

    def roll_back(self, loss: float) -> None:
        """NaN/Inf loss: reload the last checkpoint but keep the data position, so the batches since it are
        skipped (a bad batch window is the usual cause); stop with a report after ``max_nan_rollbacks`` tries."""
        cfg = self.config
        self.nan_rollbacks += 1
        self.checkpoints.wait()
        if self.nan_rollbacks > cfg.max_nan_rollbacks:
            raise NonFiniteLossError(
                f"step {self.step}: loss is {loss} and {cfg.max_nan_rollbacks} rollbacks did not help; lower --lr or "
                f"check the data near sample {self.loader.consumed_samples}. The checkpoints in {cfg.run_dir} are intact"
            )
        position = self.loader.state_dict()
        restored = self._restore_newest_intact()
        if restored is None:
            raise NonFiniteLossError(
                f"step {self.step}: loss is {loss} and there is no checkpoint to roll back to; lower --lr or check "
                f"the data near sample {self.loader.consumed_samples}"
            )
        self.step = int(restored.train_state.get("step", restored.step))
        self.schedule.steps = int(restored.train_state.get("schedule", {}).get("steps", self.step))
        self.loader.load_state_dict(position)  # skip the window: continue after the bad batch
        if self.rank == 0:
            log.warning(
                "loss %s: rolled back to %s (step %d), skipping to sample %d (rollback %d of %d)",
                loss,
                restored.location,
                self.step,
                self.loader.consumed_samples,
                self.nan_rollbacks,
                cfg.max_nan_rollbacks,
            )
        self.metrics.write(
            {
                "step": self.step,
                "event": "nan_rollback",
                "bad_loss": str(loss),
                "consumed_samples": self.loader.consumed_samples,
            }
        )
