"""The memory tier's pace: which steps a memory-only save is due at, and how that interval adapts.

``--memory-every K`` asks for a memory checkpoint every ``K`` steps. A memory-only save that comes due while the
previous one is still being written on some rank cannot start without blocking training, so it is *left out*
(:meth:`MemoryPace.left_out`): counted, logged, and the effective interval doubles (``K``, ``2K``, ``4K``...), so the
next saves come due at what the tier can sustain instead of being left out one after another. Once
:data:`KEEP_UP` saves in a row start with nothing in flight (:meth:`MemoryPace.kept_up`), the interval halves back
towards ``K``. A due step is a multiple of the effective interval, so the schedule needs no history and a
restarted process starts at ``K`` again.

Every rank holds the same pace: it changes only on a left-out save or a kept-up one, and whether the previous save
is still in flight is agreed over the world before either (``CheckpointManager._busy_anywhere``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["KEEP_UP", "MemoryPace"]

log = logging.getLogger(__name__)

#: saves in a row that must start with nothing in flight before the effective interval halves.
KEEP_UP = 2


@dataclass
class MemoryPace:
    """The effective memory interval of one rank (the same on every rank), and what it did."""

    every: int
    #: the interval saves come due at now: ``every`` times a power of two.
    effective: int = 0
    #: memory saves left out so far (the previous one still in flight).
    left: int = 0
    #: the steps left out, in order.
    left_steps: list[int] = field(default_factory=list)
    #: the largest effective interval so far.
    widest: int = 0
    #: ``(step, interval)`` for each change of the effective interval.
    changes: list[tuple[int, int]] = field(default_factory=list)
    _streak: int = 0

    def __post_init__(self) -> None:
        self.effective = self.effective or self.every
        self.widest = max(self.widest, self.effective)

    def due(self, step: int) -> bool:
        """Whether a memory-only save is due at ``step``."""
        return self.every > 0 and step % self.effective == 0

    def left_out(self, step: int, in_flight: int | None) -> None:
        """The save of ``step`` was left out (the save of ``in_flight`` still being written): count it, widen the
        interval, log both."""
        self.left += 1
        self.left_steps.append(step)
        self._streak = 0
        what = "an earlier step" if in_flight is None else f"step {in_flight}"
        if not self.every:  # memory checkpoints only with persistent saves: no interval of their own to widen
            log.warning(
                "memory checkpoint of step %d left out (%d so far): the memory save of %s is still being written",
                step,
                self.left,
                what,
            )
            return
        before = self.effective
        self.effective *= 2
        self.widest = max(self.widest, self.effective)
        self.changes.append((step, self.effective))
        log.warning(
            "memory checkpoint of step %d left out (%d so far): the memory save of %s is still being written; the "
            "memory interval is now %d steps (was %d, --memory-every %d)",
            step,
            self.left,
            what,
            self.effective,
            before,
            self.every,
        )

    def kept_up(self, step: int) -> None:
        """The save of ``step`` starts with nothing in flight; after :data:`KEEP_UP` in a row a widened interval
        halves back towards ``--memory-every``."""
        self._streak += 1
        if self.effective > self.every and self._streak >= KEEP_UP:
            self._streak = 0
            self.effective //= 2
            self.changes.append((step, self.effective))
            log.info(
                "memory tier keeps up again: the memory interval is now %d steps (--memory-every %d)",
                self.effective,
                self.every,
            )

    def summary(self) -> dict:
        """What the pace did, for the run's metrics."""
        return {
            "memory_every": self.every,
            "effective_every": self.effective,
            "widest_every": self.widest,
            "left_out": self.left,
            "left_out_steps": list(self.left_steps),
            "interval_changes": [list(c) for c in self.changes],
        }
