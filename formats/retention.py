"""Retention of a run directory's checkpoints, and removal of what failed saves left behind.

The same policy serves ``moeckpt gc`` and the trainer (after each commit): keep the newest ``keep_last`` committed
steps and every step that is a multiple of ``keep_every``; remove older committed steps and every uncommitted
leftover (staging directories of interrupted local saves, step prefixes without an index on object stores).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checkpoint import STAGING_SUFFIX, STEP_PREFIX, is_committed
from .errors import MoeckptError
from .storage import Storage


class RetentionError(MoeckptError, ValueError):
    """A retention policy that would keep nothing, or another bad request."""


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """Which committed checkpoints of a run to keep."""

    #: keep this many newest committed steps (at least 1: the newest checkpoint is never removed).
    keep_last: int = 3
    #: also keep every step that is a multiple of this (0: none).
    keep_every: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise RetentionError(f"keep_last={self.keep_last} must be >= 1: the newest checkpoint is never removed")
        if self.keep_every < 0:
            raise RetentionError(f"keep_every={self.keep_every} must be >= 0")


@dataclass(frozen=True)
class GcPlan:
    """What a garbage collection keeps and removes (names below the run directory)."""

    keep: list[str]
    remove_committed: list[str]
    remove_uncommitted: list[str]


def _step_of(name: str) -> int | None:
    digits = name[len(STEP_PREFIX) :]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def plan_gc(run_dir: str, policy: RetentionPolicy) -> GcPlan:
    """Decide, without removing anything, what ``gc`` would do to ``run_dir``."""
    storage = Storage(run_dir)
    committed: list[tuple[int, str]] = []
    uncommitted: list[str] = []
    for name in storage.listdir():
        step = _step_of(name)
        if step is not None:
            if is_committed(storage.child(name)):
                committed.append((step, name))
            else:
                uncommitted.append(name)
        elif name.startswith(f".{STEP_PREFIX}") and (STAGING_SUFFIX in name or ".old-" in name):
            uncommitted.append(name)
    committed.sort()
    newest = {name for _, name in committed[-policy.keep_last :]}
    keep = [n for s, n in committed if n in newest or (policy.keep_every and s % policy.keep_every == 0)]
    remove = [n for _, n in committed if n not in keep]
    return GcPlan(keep=keep, remove_committed=remove, remove_uncommitted=sorted(uncommitted))


def apply_gc(run_dir: str, plan: GcPlan) -> None:
    """Remove what ``plan`` says: on object stores each checkpoint's index goes first, so none is left half-deleted
    but still committed."""
    storage = Storage(run_dir)
    for name in plan.remove_committed:
        child = storage.child(name)
        child.remove("moeckpt.json")
        child.remove()
    for name in plan.remove_uncommitted:
        storage.child(name).remove()
