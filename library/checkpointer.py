"""``moeckpt.Checkpointer``: a run directory of step checkpoints for any trainer.

``run_dir/step-XXXXXXXX`` checkpoints, saved (by default in the background) with :func:`moeckpt.async_save`'s
guarantee, kept by a retention policy (the newest ``keep_last``, every multiple of ``keep_every``), and found
again by :meth:`Checkpointer.load_latest`: the newest committed step that reads back intact, a damaged one
(checksum mismatch, truncated or missing file) being set aside (``damaged-step-...``) and the previous one tried,
on every rank alike. The bundled trainer's run directories follow the same rules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from moeckpt.formats.backend import get_backend
from moeckpt.formats.checkpoint import committed_steps, quarantine, step_dir_name
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError, MoeckptError
from moeckpt.formats.retention import RetentionPolicy, apply_gc, plan_gc
from moeckpt.formats.storage import join
from moeckpt.reshard import collectives

from .save_load import AsyncSave, SaveStats, async_save, coordination_group, load, save

__all__ = ["DAMAGED_CHECKPOINT_ERRORS", "Checkpointer"]

log = logging.getLogger(__name__)

#: what a damaged checkpoint raises on load, on every rank alike: the previous checkpoint is tried then.
DAMAGED_CHECKPOINT_ERRORS = (ChecksumMismatchError, DataFileError)


class Checkpointer:
    """Step checkpoints of one run in ``run_dir`` (a local path or an fsspec URL); every method is collective."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        keep_every: int = 0,
        async_save: bool = True,
        process_group=None,
        format: str = "safetensors",
        compress: str = NONE,
    ) -> None:
        get_backend(format, compress=compress)  # a format that cannot compress is refused here, not at a save
        self.run_dir = os.fspath(run_dir)
        self.retention = RetentionPolicy(keep_last=keep_last, keep_every=keep_every)
        self.async_save = async_save
        self.process_group = process_group
        self.format = format
        #: the compression setting of every checkpoint (``"blosc-zstd"``: ``format="zarr"`` only).
        self.compress = compress
        self._inflight: AsyncSave | None = None
        self._inflight_step: int | None = None

    def step_path(self, step: int) -> str:
        """Where the checkpoint of ``step`` lives."""
        return join(self.run_dir, step_dir_name(step))

    def save(self, step: int, state_dict: Mapping[str, Any]) -> SaveStats:
        """Checkpoint ``state_dict`` as step ``step``; returns once it is snapshotted (async) or committed.

        The previous background save is waited for first (and its failure raised here). After a commit, rank 0
        applies the retention policy (uncommitted leftovers are left to ``moeckpt gc``: another save may be
        writing them).
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        self.wait()
        path = self.step_path(step)
        if self.async_save:
            handle = async_save(
                state_dict,
                path,
                process_group=self.process_group,
                format=self.format,
                compress=self.compress,
                overwrite=True,
                step=step,
            )
            self._inflight, self._inflight_step = handle, step
            return handle.stats
        stats = save(
            state_dict,
            path,
            process_group=self.process_group,
            format=self.format,
            compress=self.compress,
            overwrite=True,
            step=step,
        )
        self._retain()
        return stats

    def wait(self) -> SaveStats | None:
        """Wait for the save in flight (if any) to commit, then apply retention; raises if it failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        stats = inflight.wait()
        self._retain()
        return stats

    def _retain(self) -> None:
        if collectives.rank(coordination_group(self.process_group)) == 0:
            plan = plan_gc(self.run_dir, self.retention)
            plan = type(plan)(keep=plan.keep, remove_committed=plan.remove_committed, remove_uncommitted=[])
            apply_gc(self.run_dir, plan)

    def steps(self) -> list[int]:
        """The committed steps of the run, oldest first."""
        return [s for s, _ in committed_steps(self.run_dir)]

    def load_latest(self, state_dict: MutableMapping[str, Any]) -> int | None:
        """Load the newest committed step that reads back intact into ``state_dict`` (in place); its step, or
        ``None`` when the run has no checkpoint yet. Damaged checkpoints are moved aside on the way."""
        self.wait()
        group = coordination_group(self.process_group)
        me = collectives.rank(group)
        found = [[s, st.location] for s, st in reversed(committed_steps(self.run_dir))] if me == 0 else None
        candidates = collectives.all_gather_json(found, group)[0]
        for step, location in candidates:
            try:
                load(state_dict, location, process_group=self.process_group)
                return int(step)
            except DAMAGED_CHECKPOINT_ERRORS as e:
                moved = quarantine(location) if me == 0 else None
                moved = collectives.all_gather_json(moved, group)[0]
                log.warning(
                    "checkpoint of step %s is damaged (%s); moved it to %s, trying the previous one", step, e, moved
                )
        if candidates:
            raise MoeckptError(
                f"{self.run_dir}: all {len(candidates)} committed checkpoints are damaged; restore one from a copy"
            )
        return None

    def close(self) -> None:
        """Wait for the save in flight."""
        self.wait()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
