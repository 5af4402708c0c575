"""Learning-rate schedule: linear warmup to the peak, then cosine decay to a floor, then constant at the floor.

The rate is a pure function of the step index, so resuming only needs the step count (kept as plain JSON).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LRSchedule", "ScheduleConfig"]


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """Warmup-cosine schedule settings."""

    #: peak learning rate, reached at the end of warmup.
    lr: float = 3e-4
    #: steps of linear warmup; step ``i < warmup_steps`` uses ``lr * (i + 1) / warmup_steps``.
    warmup_steps: int = 0
    #: step at which the cosine reaches the floor (usually the run's total steps); constant afterwards.
    decay_steps: int = 1000
    #: the floor as a fraction of ``lr``.
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")
        if type(self.warmup_steps) is not int or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps!r} must be a non-negative integer")
        if type(self.decay_steps) is not int or self.decay_steps < self.warmup_steps:
            raise ValueError(
                f"decay_steps={self.decay_steps!r} must be an integer at least warmup_steps={self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must lie in [0, 1]")


class LRSchedule:
    """The rate for each optimizer step; :meth:`next` returns it and advances the step counter."""

    def __init__(self, config: ScheduleConfig | None = None) -> None:
        self.config = config or ScheduleConfig()
        #: optimizer steps taken so far (the index of the next step).
        self.steps = 0

    def lr_at(self, step: int) -> float:
        """The learning rate of the 0-based optimizer step ``step``."""
        c = self.config
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        floor = c.lr * c.min_lr_ratio
        if step >= c.decay_steps:
            return floor
        progress = (step - c.warmup_steps) / (c.decay_steps - c.warmup_steps)
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (c.lr - floor)

    def next(self) -> float:
        """The rate of the next step; advances the counter."""
        lr = self.lr_at(self.steps)
        self.steps += 1
        return lr

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON: the step counter and, for the record, the settings it ran with."""
        return {"steps": self.steps, "config": asdict(self.config)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the step counter. The current settings stay in force, so a resumed run may extend its schedule."""
        steps = state.get("steps") if isinstance(state, Mapping) else None
        if type(steps) is not int or steps < 0:
            raise ValueError(f"schedule state: 'steps' must be a non-negative integer, got {steps!r}")
        self.steps = steps
