"""How a checkpoint becomes visible atomically: the two commit strategies, as types.

A checkpoint exists only once its index ``moeckpt.json`` is written, last, after every data file is durable.
What "atomically" takes depends on the storage, and each :class:`~moeckpt.formats.storage.Storage` names its
strategy (``storage.commit_strategy``), so :mod:`moeckpt.formats.checkpoint` never branches on the kind:

* :class:`RenameStagingDir` (local disk): everything is written into a sibling staging directory
  ``.<name>.partial``, fsynced, and renamed into place; the rename is the commit.
* :class:`IndexLast` (object stores and every other fsspec URL): data objects are written in place and the index
  is uploaded last; object stores make single objects appear atomically, so a reader never sees an index before
  all the data.

Readers ignore any directory without an index; ``moeckpt gc`` removes such leftovers.
"""

from __future__ import annotations

import os
import uuid
from typing import Protocol

from .index import INDEX_NAME
from .storage import Storage

STAGING_SUFFIX = ".partial"


class CommitStrategy(Protocol):
    """The steps of a save that differ between storages."""

    def staging(self, final: Storage) -> Storage:
        """Where the data of a save to ``final`` is written before the commit (the same for every rank)."""
        ...

    def begin(self, final: Storage, contents: list[str]) -> Storage:
        """Clear what a save to ``final`` replaces (``contents``: its current entries) and return the staging
        storage, ready for data."""
        ...

    def commit(self, final: Storage, index: bytes) -> None:
        """Write the index bytes last and make the checkpoint visible."""
        ...

    def discard(self, final: Storage) -> None:
        """After a failed save to ``final``: drop what it staged, or at least stop what it still uploads."""
        ...

    def quarantine(self, final: Storage) -> str:
        """Take a damaged checkpoint out of its run (resume skips it, a new save can take its step); returns where
        it went."""
        ...


class RenameStagingDir:
    """Local disk: stage in ``.<name>.partial`` beside the target, fsync, rename into place."""

    def staging(self, final: Storage) -> Storage:
        parent, name = os.path.split(final.location)
        return final.at(os.path.join(parent, f".{name}{STAGING_SUFFIX}"))

    def begin(self, final: Storage, contents: list[str]) -> Storage:
        del contents  # the old checkpoint stays whole until the rename replaces it
        staging = self.staging(final)
        staging.remove()
        staging.makedirs()
        return staging

    def commit(self, final: Storage, index: bytes) -> None:
        staging = self.staging(final)
        staging.write_bytes(INDEX_NAME, index)
        staging.fsync_dir()
        parent = os.path.dirname(final.location)
        old = None
        if os.path.exists(final.location):
            old = os.path.join(parent, f".{os.path.basename(final.location)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final.location, old)
        os.rename(staging.location, final.location)
        final.at(parent).fsync_dir()
        if old is not None:
            final.at(old).remove()

    def discard(self, final: Storage) -> None:
        self.staging(final).remove()

    def quarantine(self, final: Storage) -> str:
        """Renamed to a visible sibling ``damaged-<name>-<id>`` and kept whole for inspection (``gc`` leaves it
        alone; delete it when done)."""
        location = final.location.rstrip("/")
        target = os.path.join(os.path.dirname(location), f"damaged-{os.path.basename(location)}-{uuid.uuid4().hex[:8]}")
        os.rename(location, target)
        final.at(os.path.dirname(target)).fsync_dir()
        return target


class IndexLast:
    """Object stores: data objects in place, the index uploaded last (single objects appear atomically)."""

    def staging(self, final: Storage) -> Storage:
        return final

    def begin(self, final: Storage, contents: list[str]) -> Storage:
        final.allow_uploads()
        if contents:
            # The index goes first, so the old checkpoint stops being committed before any of its data is touched.
            final.remove(INDEX_NAME)
            final.remove()
        return final

    def commit(self, final: Storage, index: bytes) -> None:
        final.write_bytes(INDEX_NAME, index)

    def discard(self, final: Storage) -> None:
        # The objects written stay for `gc` (or the next save of this location) to remove; the uploads still in
        # flight are aborted now, so none is left billed.
        final.cancel_uploads()

    def quarantine(self, final: Storage) -> str:
        """Object stores cannot rename: the index is removed, so the checkpoint becomes an uncommitted leftover that
        the next save of that step (or ``gc``) replaces."""
        final.remove(INDEX_NAME)
        return final.location
