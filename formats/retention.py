"""Retention of a run directory's checkpoints, and removal of what failed saves left behind.

The same policy serves ``moeckpt gc`` and the trainer (after each commit): keep the newest ``keep_last`` committed
steps and every step that is a multiple of ``keep_every``; remove older committed steps and every uncommitted
leftover (staging directories of interrupted local saves, step prefixes without an index on object stores), and
abort the multipart uploads that killed saves left on an object store (whose parts are billed until aborted).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .checkpoint import STAGING_SUFFIX, STEP_PREFIX, is_committed
from .errors import MoeckptError
from .index import INDEX_NAME
from .storage import Upload
from .storages import open_storage

log = logging.getLogger(__name__)

#: a multipart upload older than this (seconds) belongs to no save in flight: a save uploads each of its files
#: in minutes at most, so an hour leaves a wide margin while a killed save's parts are still aborted the same day.
UPLOAD_GRACE_S = 3600.0


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
    #: incomplete multipart uploads below the run directory, older than the grace age (object stores only).
    stale_uploads: list[Upload] = field(default_factory=list)


def _step_of(name: str) -> int | None:
    digits = name[len(STEP_PREFIX) :]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def plan_gc(run_dir: str, policy: RetentionPolicy, *, upload_grace_s: float = UPLOAD_GRACE_S) -> GcPlan:
    """Decide, without removing anything, what ``gc`` would do to ``run_dir``.

    Multipart uploads started more than ``upload_grace_s`` seconds ago are stale (a save in flight is younger);
    ``0`` takes every upload, for a run directory that no process writes to.
    """
    if not upload_grace_s >= 0:  # NaN too
        raise RetentionError(f"upload_grace_s={upload_grace_s} must be a number of seconds >= 0")
    storage = open_storage(run_dir)
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
    stale = sorted(storage.stale_uploads(upload_grace_s), key=lambda u: u.relpath)
    return GcPlan(keep=keep, remove_committed=remove, remove_uncommitted=sorted(uncommitted), stale_uploads=stale)


def apply_gc(run_dir: str, plan: GcPlan) -> None:
    """Remove what ``plan`` says: on object stores each checkpoint's index goes first, so none is left half-deleted
    but still committed; stale uploads are aborted first, so their parts stop being billed even if a removal
    fails."""
    storage = open_storage(run_dir)
    for upload in plan.stale_uploads:
        storage.abort_upload(upload)
        log.info("aborted the multipart upload of %s (%.0f s old)", storage.path(upload.relpath), upload.age_s)
    for name in plan.remove_committed:
        child = storage.child(name)
        child.remove(INDEX_NAME)
        child.remove()
    for name in plan.remove_uncommitted:
        storage.child(name).remove()
