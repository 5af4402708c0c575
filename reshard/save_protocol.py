"""The one protocol every distributed save follows: each rank writes its pieces, a coordinator commits the index
only if every rank did. The library's ``moeckpt.save`` / ``async_save``, the trainer's persistent saves and its
memory tier all save through :func:`save_collective`; what differs between them is a hook, never the order.

The order, collective over a gloo ``group``:

1. each *coordinator* (one rank per distinct ``location``: rank 0 when every rank saves to one place, each
   node's leader in the memory tier) runs ``hooks.before_begin`` (the memory tier's pruning), prepares its
   location (:func:`~moeckpt.formats.checkpoint.begin_save`: refuses a non-empty destination unless told, sets up
   the staging area) and, given ``boxes``, the backend's shared metadata; every rank learns whether that worked;
2. every rank writes its own pieces through the backend (its file, or its zarr cells), then runs
   ``hooks.after_write`` (the trainer's fault injection: a rank that dies here has written, nothing is committed);
3. the ranks exchange what they wrote (file names, sizes, checksums) as JSON;
4. ``hooks.before_commit`` runs on every rank with every rank's files (collective: the memory tier replicates each
   node's part to its buddies here, so nothing commits before its replicas exist);
5. each coordinator finishes the backend and writes the index last (the commit); every rank learns the outcome;
6. ``hooks.after_commit`` runs on every rank with the committed index (the trainer's retention on rank 0, its
   corrupt-after-commit fault).

A failure on any rank fails the save on every rank with the same error, and nothing is committed: an error of a
known moeckpt class at the start is raised as that class everywhere, every other failure as ``failure`` (a
:class:`SaveFailedError`, or a subclass of it such as the memory tier's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import begin_save, commit, staging_storage
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import FileEntry, Index, TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storage import Storage

from . import collectives
from .runtime import cores_per_rank

__all__ = ["MAX_WRITE_THREADS", "SaveFailedError", "SaveHooks", "SaveWriter", "save_collective", "write_threads"]

log = logging.getLogger(__name__)


class SaveFailedError(MoeckptError, RuntimeError):
    """A distributed save failed on some rank; nothing was committed."""


class SaveWriter(Protocol):
    """What the protocol writes with: a backend's ``prepare``, ``write`` and ``finish`` (any
    :class:`~moeckpt.formats.backend.Backend`, or a writer of the caller's that stores this rank's file otherwise,
    such as the memory tier's ring)."""

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None: ...

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]: ...

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]: ...


@dataclass(frozen=True)
class SaveHooks:
    """What a caller adds to :func:`save_collective`, each at one point of its order (see the module docstring).

    ``before_begin()``: on each coordinator, before its location is prepared. ``after_write(written)``: on this
    rank, after its files are written and before anything is exchanged. ``before_commit(files_by_rank)``: on every
    rank, collective, with every rank's written files; it must raise alike on every rank or on none.
    ``after_commit(index)``: on every rank, once every coordinator has committed.
    """

    before_begin: Callable[[], None] | None = None
    after_write: Callable[[list[FileEntry]], None] | None = None
    before_commit: Callable[[list[list[FileEntry]]], None] | None = None
    after_commit: Callable[[Index], None] | None = None


_NO_HOOKS = SaveHooks()


def save_collective(
    location: str,
    index: Index,
    pieces: Sequence[Piece],
    boxes: dict[str, list[Box]] | None = None,
    *,
    group=None,
    overwrite: bool = False,
    replace_uncommitted: bool = False,
    backend: SaveWriter | None = None,
    threads: int | None = None,
    coordinator: bool | None = None,
    hooks: SaveHooks = _NO_HOOKS,
    failure: type[SaveFailedError] = SaveFailedError,
    commit_log_level: int = logging.INFO,
) -> Index:
    """Save this rank's ``pieces`` of the checkpoint ``index`` describes to ``location``; collective over ``group``
    (a gloo group; ``None``: the default group, or a single process).

    ``location`` may differ between ranks: the ranks of one location share it, its lowest rank coordinates it, and
    every location's index lists every rank's files (the memory tier, whose nodes each commit their own copy).
    ``coordinator``: whether this rank prepares and commits its location, true on exactly one rank of each
    location (default: rank 0, for one location shared by every rank).
    ``boxes`` lists every stored piece of every tensor over all ranks, for the backend's ``prepare`` (``None``:
    no prepare, for a backend that needs none). ``backend``: the instance to write with (default: a new one of
    ``index.backend``); ``threads``: how many threads this rank writes with (default :func:`write_threads`).
    ``index.files`` is replaced by what the ranks wrote. Returns the committed index.
    """
    rank = collectives.rank(group)
    if coordinator is None:
        coordinator = rank == 0
    writer: SaveWriter = backend if backend is not None else get_backend(index.backend, compress=index.compress)
    error = None
    if coordinator:
        try:
            if hooks.before_begin is not None:
                hooks.before_begin()
            begin_save(location, overwrite=overwrite, replace_uncommitted=replace_uncommitted)
            if boxes is not None:
                writer.prepare(staging_storage(location), index.tensors, boxes)
        except MoeckptError as e:
            error = {"type": type(e).__name__, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank, or they would write into nothing
            error = {"type": failure.__name__, "message": f"rank {rank} could not start the save: {e}"}
    started = [e for e in collectives.all_gather_json(error, group) if e]
    if started:
        raise _typed(started[0], failure)
    try:
        written = writer.write(
            staging_storage(location),
            rank,
            list(pieces),
            index.tensors,
            threads=write_threads(group) if threads is None else threads,
        )
        if hooks.after_write is not None:
            hooks.after_write(written)
        mine: dict = {"ok": True, "files": [[f.path, f.size, f.checksum] for f in written]}
    except Exception as e:  # noqa: BLE001 - every rank must learn of it, or a coordinator would commit a torn one
        mine = {"ok": False, "error": f"rank {rank}: {e}"}
    everyone = collectives.all_gather_json(mine, group)
    failures = [r["error"] for r in everyone if not r["ok"]]
    if failures:
        raise failure(f"{location}: the save failed: {'; '.join(failures)}")
    by_rank = [[FileEntry(path=p, size=n, checksum=c) for p, n, c in r["files"]] for r in everyone]
    if hooks.before_commit is not None:
        hooks.before_commit(by_rank)
    outcome = None
    final = index
    if coordinator:
        try:
            files = writer.finish(staging_storage(location), [f for fs in by_rank for f in fs], index.tensors)
            final = replace(index, files={f.path: f for f in files})
            commit(location, final)
            log.log(commit_log_level, "committed %s (step %d, %d files)", location, final.step, len(final.files))
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below
            outcome = f"{location}: rank {rank} could not commit: {e}"
    outcomes = [o for o in collectives.all_gather_json(outcome, group) if o]
    if outcomes:
        raise failure("; ".join(outcomes))
    if not coordinator:
        final = replace(index, files={f.path: f for fs in by_rank for f in fs})
    if hooks.after_commit is not None:
        hooks.after_commit(final)
    return final


#: the most threads one rank writes its file with.
MAX_WRITE_THREADS = 3


def write_threads(group=None, *, most: int = MAX_WRITE_THREADS) -> int:
    """Threads each saving rank writes its own file with: its share of the host's cores
    (:func:`~moeckpt.reshard.runtime.cores_per_rank`), at most ``most``.

    One thread hashing and copying is the limit of a save where cores are spare (4 ranks on 16 cores); where
    ranks outnumber cores, more threads only take turns."""
    return min(most, cores_per_rank(group))


def _typed(error: dict, failure: type[SaveFailedError]) -> MoeckptError:
    """A coordinator's error as the same class on every rank where it is a known moeckpt error, else ``failure``."""
    from moeckpt.formats import errors

    cls = getattr(errors, error["type"], None)
    if isinstance(cls, type) and issubclass(cls, MoeckptError):
        return cls(error["message"])
    return failure(error["message"])
