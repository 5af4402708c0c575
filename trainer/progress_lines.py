"""The live progress lines of rank 0 during a run: step/total, loss, lr, gradient norm, throughput, the time
blocked by saves and the time left at the recent pace (every ``--log-every`` steps)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .logs import progress

if TYPE_CHECKING:
    from .step_loop import Trainer

__all__ = ["ProgressLines"]


class ProgressLines:
    """The live progress lines of rank 0: every ``log_every`` steps, step/total, loss, lr, gradient norm,
    throughput, time blocked by saves and the time left at the recent pace."""

    def __init__(self, trainer: Trainer, stop: int) -> None:
        self.every = trainer.config.log_every if trainer.rank == 0 else 0
        self.total = trainer.config.steps
        self.stop = stop
        self.first_step = trainer.step
        self.t0 = time.perf_counter()
        self.blocked = 0.0

    def step(self, record: dict[str, Any]) -> None:
        if not self.every:
            return
        self.blocked += record["save_blocked_s"]
        step = record["step"]
        if step % self.every:
            return
        elapsed = time.perf_counter() - self.t0
        done = step - self.first_step
        eta = elapsed / done * (self.stop - step) if done > 0 else 0.0
        progress().info(
            "step %d/%d  loss %.4f  lr %.2e  grad norm %.3f  %s tok/s  save blocked %.2f s  ETA %s",
            step,
            self.total,
            record["loss"],
            record["lr"],
            record["grad_norm"],
            _si(record["tokens_per_s"]),
            self.blocked,
            _duration(eta),
        )
        self.blocked = 0.0


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
