"""A checkpoint saved by many processes at once: each writes its pieces, one commits the index only if all did.

The protocol every distributed save follows (the library's ``moeckpt.save`` and the bundled trainer alike):

1. rank 0 prepares the location (:func:`~moeckpt.formats.checkpoint.begin_save`: refuses a non-empty destination
   unless told, sets up the staging area) and the backend's shared metadata; every rank learns whether that worked;
2. every rank writes its own pieces through the backend (its file, or its zarr cells);
3. the ranks exchange what they wrote (file names, sizes, checksums) as JSON over a gloo group;
4. rank 0 finishes the backend, writes the index last (the commit), and every rank learns the outcome.

A failure on any rank fails the save on every rank with the same error, and nothing is committed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import begin_save, commit, staging_storage
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import FileEntry, Index
from moeckpt.formats.pieces import Piece

from . import collectives
from .runtime import cores_per_rank

__all__ = ["SaveFailedError", "save_collective", "write_threads"]

log = logging.getLogger(__name__)


class SaveFailedError(MoeckptError, RuntimeError):
    """A distributed save failed on some rank; nothing was committed."""


def save_collective(
    location: str,
    index: Index,
    pieces: Sequence[Piece],
    boxes: dict[str, list[Box]],
    *,
    group=None,
    overwrite: bool = False,
    replace_uncommitted: bool = False,
    after_write=None,
) -> Index:
    """Save this rank's ``pieces`` of the checkpoint ``index`` describes to ``location``; collective over ``group``
    (a gloo group; ``None``: the default group, or a single process).

    ``boxes`` lists every stored piece of every tensor over all ranks (the backend's ``prepare`` needs it, on rank
    0). ``index.files`` is replaced by what the ranks wrote. ``after_write`` (the trainer's fault injection) runs
    on each rank after its data is written and before anything is exchanged. Returns the committed index.
    """
    rank = collectives.rank(group)  # the rank within the group: 0 coordinates
    backend = get_backend(index.backend)
    error = None
    if rank == 0:
        try:
            begin_save(location, overwrite=overwrite, replace_uncommitted=replace_uncommitted)
            backend.prepare(staging_storage(location), index.tensors, boxes)
        except MoeckptError as e:
            error = {"type": type(e).__name__, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank, or they would write into nothing
            error = {"type": "SaveFailedError", "message": f"rank 0 could not start the save: {e}"}
    error = collectives.all_gather_json(error, group)[0]
    if error:
        raise _typed(error)
    try:
        written = backend.write(
            staging_storage(location), rank, list(pieces), index.tensors, threads=write_threads(group)
        )
        if after_write is not None:
            after_write()
        mine: dict = {"ok": True, "files": [[f.path, f.size, f.checksum] for f in written]}
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or rank 0 would commit a torn checkpoint
        mine = {"ok": False, "error": f"rank {rank}: {e}"}
    everyone = collectives.all_gather_json(mine, group)
    failures = [r["error"] for r in everyone if not r["ok"]]
    if failures:
        raise SaveFailedError(f"{location}: the save failed: {'; '.join(failures)}")
    outcome = None
    final = index
    if rank == 0:
        try:
            files = [FileEntry(path=p, size=n, checksum=c) for r in everyone for p, n, c in r["files"]]
            files = backend.finish(staging_storage(location), files, index.tensors)
            final = replace(index, files={f.path: f for f in files})
            commit(location, final)
            log.info("committed %s (step %d, %d files)", location, final.step, len(final.files))
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below
            outcome = f"rank 0 could not commit: {e}"
    outcome = collectives.all_gather_json(outcome, group)[0]
    if outcome:
        raise SaveFailedError(f"{location}: {outcome}")
    return final


#: the most threads one rank writes its file with.
MAX_WRITE_THREADS = 3


def write_threads(group=None, *, most: int = MAX_WRITE_THREADS) -> int:
    """Threads each saving rank writes its own file with: its share of the host's cores
    (:func:`~moeckpt.reshard.runtime.cores_per_rank`), at most ``most``.

    One thread hashing and copying is the limit of a save where cores are spare (4 ranks on 16 cores); where
    ranks outnumber cores, more threads only take turns."""
    return min(most, cores_per_rank(group))


def _typed(error: dict) -> MoeckptError:
    """Rank 0's error as the same class on every rank where it is a known moeckpt error, else SaveFailedError."""
    from moeckpt.formats import errors

    cls = getattr(errors, error["type"], None)
    if isinstance(cls, type) and issubclass(cls, MoeckptError):
        return cls(error["message"])
    return SaveFailedError(error["message"])
