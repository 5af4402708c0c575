"""Where a ``dcp.save`` through ``moeckpt.dcp`` goes: it replaces only its own files, as DCP's FileSystemWriter does.

A destination holds at most one checkpoint (its index ``moeckpt.json``, the files the index lists, and the
backend's objects) and may hold anything else beside it: ``torch_save_to_dcp("dir/model.pt", "dir")`` writes the
checkpoint next to its own source. The writer never removes a file that it did not write:

* **Nothing foreign there** (absent, empty, or only a committed checkpoint): the usual commit protocol of
  :mod:`moeckpt.formats.checkpoint`. On local disk the data is staged in ``.<name>.partial`` and renamed into
  place, so a checkpoint being replaced stays whole until the new one is committed.
* **Other files there**: the data is staged as usual (local disk) or written in place (object stores, which have
  no rename), and at the commit the replaced checkpoint's index goes first, then its own files; the new files move
  in and the new index is written last. A file of the new checkpoint that would land on a foreign one is refused
  before anything is written.

``overwrite=False`` refuses a destination that holds a committed checkpoint, as FileSystemWriter does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field

from moeckpt.formats.backend import get_backend
from moeckpt.formats.checkpoint import begin_save, commit
from moeckpt.formats.commit import RenameStagingDir
from moeckpt.formats.errors import DestinationNotEmptyError
from moeckpt.formats.index import INDEX_NAME, Index
from moeckpt.formats.storage import Storage
from moeckpt.formats.storages import open_storage

__all__ = ["Destination", "prepare_destination", "top_level_names"]

log = logging.getLogger(__name__)

_TMP_INDEX = f".{INDEX_NAME}.tmp"


@dataclass
class Destination:
    """What :func:`prepare_destination` found and chose; :meth:`commit` finishes the save."""

    location: str
    final: Storage
    in_place: bool
    replaced: set[str] = field(default_factory=set)  # the replaced checkpoint's own objects, its index included

    def commit(self, index: Index) -> None:
        """Write the index last and make the checkpoint visible, replacing only the old checkpoint's own files."""
        if not self.in_place:
            commit(self.location, index)
            return
        strategy = self.final.commit_strategy
        if not isinstance(strategy, RenameStagingDir):
            # Written in place, the replaced checkpoint's files already gone (prepare_destination): the index last.
            strategy.commit(self.final, index.dumps())
            return
        staging = strategy.staging(self.final)
        staged = staging.listdir()
        foreign = _foreign_top(self.final, self.replaced)
        clash = sorted(set(staged) & foreign)
        if clash:
            staging.remove()
            raise _clash_error(self.location, clash)
        _remove_own(self.final, self.replaced)
        self.final.makedirs()
        for name in staged:
            os.rename(staging.path(name), self.final.path(name))
        self.final.write_parts(_TMP_INDEX, [index.dumps()])
        os.replace(self.final.path(_TMP_INDEX), self.final.path(INDEX_NAME))
        self.final.fsync_dir()
        staging.remove()
        log.info("committed %s beside %d other entries (step %d)", self.location, len(foreign), index.step)


def top_level_names(backend: str, writers: int, tensors: Collection[str]) -> set[str] | None:
    """The top-level entries a save writes with ``backend``, as the backend says (:meth:`Backend.top_level_names`;
    None for a backend whose file names are not known before it writes, or one without the method)."""
    names = getattr(get_backend(backend), "top_level_names", None)
    return names(writers, tensors) if names is not None else None


def prepare_destination(location: str, *, overwrite: bool, new_top: set[str] | None) -> Destination:
    """Before any rank writes: refuse what cannot be replaced, set up the staging, and clear what goes first.

    ``new_top`` is what :func:`top_level_names` says the save will write."""
    final = open_storage(location)
    final.refuse_file()
    replaced: set[str] = set()
    if final.exists(INDEX_NAME):
        if not overwrite:
            raise DestinationNotEmptyError(
                f"{final.location}: Checkpoint already exists and overwrite=False; pass overwrite=True to replace it "
                "(only its own files are replaced) or choose another location"
            )
        replaced = _own_objects(final)
    foreign = _foreign_top(final, replaced)
    if not foreign:
        begin_save(location, overwrite=True)
        return Destination(location, final, in_place=False, replaced=replaced)
    strategy = final.commit_strategy
    local = isinstance(strategy, RenameStagingDir)
    if new_top is None and not local:
        raise DestinationNotEmptyError(
            f"{final.location}: holds entries that are not a checkpoint's ({', '.join(sorted(foreign)[:3])}), and this "
            "backend's file names are not known before the save; choose an empty location"
        )
    clash = sorted((new_top or set()) & foreign)
    if clash:
        raise _clash_error(final.location, clash)
    if local:
        strategy.begin(final, [])  # the staging directory only; nothing at the destination is touched yet
    else:
        final.allow_uploads()
        _remove_own(final, replaced)
    log.info("%s: saving beside %d entries it did not write", final.location, len(foreign))
    return Destination(location, final, in_place=True, replaced=replaced)


def _own_objects(final: Storage) -> set[str]:
    index = Index.loads(final.read_bytes(INDEX_NAME), final.path(INDEX_NAME))
    backend = get_backend(index.backend)
    return set(backend.stored_objects(final, index)) | set(index.files) | {INDEX_NAME}


def _foreign_top(final: Storage, own: set[str]) -> set[str]:
    """The top-level entries holding anything that is not one of ``own``'s objects (a staged index's leftover
    temporary file counts as ours)."""
    out = set()
    for path in final.list_files() if final.exists() else {}:
        if path not in own and path != _TMP_INDEX:
            out.add(path.split("/", 1)[0])
    for name in final.listdir():  # empty directories hold no files, but they are there
        if not any(p.split("/", 1)[0] == name for p in own) and name != _TMP_INDEX:
            out.add(name)
    return out


def _remove_own(final: Storage, own: set[str]) -> None:
    """Remove the replaced checkpoint: its index first (it stops being committed), then each of its objects, then
    the directories that held nothing else."""
    if not own:
        return
    final.remove(INDEX_NAME)
    dirs: set[str] = set()
    for path in sorted(own - {INDEX_NAME}):
        final.remove(path)
        parts = path.split("/")[:-1]
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for d in sorted(dirs, key=lambda d: d.count("/"), reverse=True):
        if final.exists(d) and not final.listdir(d):
            final.remove(d)


def _clash_error(location: str, clash: list[str]) -> DestinationNotEmptyError:
    return DestinationNotEmptyError(
        f"{location}: {', '.join(clash[:3])} would be replaced, but no committed checkpoint there lists "
        f"{'it' if len(clash) == 1 else 'them'} (moeckpt.dcp replaces only its own files); remove "
        f"{'it' if len(clash) == 1 else 'them'} or choose another location"
    )
