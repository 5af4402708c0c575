"""Saving and opening whole checkpoints: the commit protocol and the reader.

A checkpoint exists only once its index ``moeckpt.json`` is written, last, after every data file is durable. How
that is made atomic is the storage's commit strategy (:mod:`moeckpt.formats.commit`): a staging directory renamed
into place on local disk, the index uploaded last on object stores. Readers ignore any directory without an
index; ``moeckpt gc`` removes such leftovers.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from . import dtypes
from .backend import Backend, PieceReader, get_backend
from .box import Box, covers_exactly_once
from .commit import STAGING_SUFFIX
from .errors import (
    CheckpointIndexError,
    DestinationNotEmptyError,
    MoeckptError,
    NotCommittedError,
)
from .index import INDEX_NAME, FileEntry, Index, TensorEntry
from .pieces import Piece, PieceRef
from .storage import Storage
from .storages import open_storage

if TYPE_CHECKING:
    import torch

__all__ = [
    "STAGING_SUFFIX",
    "STEP_PREFIX",
    "CheckpointReader",
    "ReusedBuffer",
    "begin_save",
    "byte_view",
    "commit",
    "committed_steps",
    "discard",
    "is_committed",
    "quarantine",
    "resolve",
    "save_pieces",
    "staging_storage",
    "step_dir_name",
    "verify",
]

STEP_PREFIX = "step-"

log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def staging_storage(location: str) -> Storage:
    """Where the data of a save to ``location`` is written before the commit (same for every rank)."""
    final = open_storage(location)
    return final.commit_strategy.staging(final)


def is_committed(storage: Storage) -> bool:
    return storage.exists(INDEX_NAME)


def begin_save(location: str, *, overwrite: bool = False, replace_uncommitted: bool = False) -> Storage:
    """Prepare a save to ``location`` and return the storage the data files go to.

    Refuses a non-empty destination unless ``overwrite``; ``replace_uncommitted`` lets a trainer reuse a
    location that only holds the leftovers of a failed save.
    """
    final = open_storage(location)
    final.refuse_file()
    contents = final.listdir()
    if contents and not overwrite:
        if not (replace_uncommitted and INDEX_NAME not in contents):
            raise DestinationNotEmptyError(
                f"{final.location}: destination is not empty ({len(contents)} entries); "
                "choose an empty location or pass --overwrite"
            )
    return final.commit_strategy.begin(final, contents)


def commit(location: str, index: Index) -> None:
    """Write the index last and make the checkpoint visible (on local disk an atomic directory rename)."""
    final = open_storage(location)
    final.commit_strategy.commit(final, index.dumps())
    log.info("committed %s (step %d, %s, %d files)", final.location, index.step, index.backend, len(index.files))


def discard(location: str) -> None:
    """After a failed save to ``location``: remove its staging directory (local disk), or abort the uploads it still
    has in flight (object stores, whose written objects ``gc`` removes)."""
    final = open_storage(location)
    final.commit_strategy.discard(final)
    log.debug("discarded the failed save to %s", final.location)


def quarantine(location: str) -> str:
    """Take a damaged checkpoint out of its run, so resume skips it and a new save can take its step; returns
    where it went.

    On local disk the directory is renamed to a visible sibling ``damaged-<name>-<id>`` and kept whole for
    inspection (``gc`` leaves it alone; delete it when done). On object stores, which cannot rename, the index is
    removed first: the checkpoint becomes an uncommitted leftover that the next save of that step (or ``gc``)
    replaces.
    """
    final = open_storage(location)
    moved = final.commit_strategy.quarantine(final)
    log.warning("quarantined the damaged checkpoint %s (now %s)", final.location, moved)
    return moved


def save_pieces(
    location: str,
    index: Index,
    pieces_by_writer: Mapping[int, Sequence[Piece]],
    *,
    overwrite: bool = False,
    workers: int = 4,
    on_written: Callable[[int], None] | None = None,
) -> Index:
    """Save a whole checkpoint from one process (``init``, offline tools): every writer's pieces, then commit.

    ``index.files`` is ignored and replaced by what the backend wrote. Returns the committed index.
    """
    backend = get_backend(index.backend, compress=index.compress)
    storage = begin_save(location, overwrite=overwrite)
    boxes: dict[str, list[Box]] = {}
    for pieces in pieces_by_writer.values():
        for p in pieces:
            if not p.box.is_empty():
                boxes.setdefault(p.tensor, []).append(p.box)
    backend.prepare(storage, index.tensors, boxes)

    def write(writer: int) -> list[FileEntry]:
        out = backend.write(storage, writer, pieces_by_writer[writer], index.tensors)
        if on_written is not None:
            on_written(sum(p.data.numel() * p.data.element_size() for p in pieces_by_writer[writer]))
        return out

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        try:
            entries = [e for es in pool.map(write, sorted(pieces_by_writer)) for e in es]
        except BaseException:
            # Before the pool waits for its other writers: they stop at their next upload, none is left behind.
            storage.cancel_uploads()
            raise
    entries = backend.finish(storage, entries, index.tensors)
    final_index = replace(index, files={e.path: e for e in entries})
    commit(location, final_index)
    return final_index


def resolve(location: str | os.PathLike[str]) -> Storage:
    """The committed checkpoint at ``location``: the checkpoint itself, or the newest committed step of a run."""
    storage = open_storage(location)
    if is_committed(storage):
        return storage
    steps = [n for n in storage.listdir() if n.startswith(STEP_PREFIX) and n[len(STEP_PREFIX) :].isdigit()]
    for name in sorted(steps, reverse=True):
        child = storage.child(name)
        if is_committed(child):
            return child
    if storage.exists() and storage.listdir():
        raise NotCommittedError(
            f"{storage.location}: no committed checkpoint here (no {INDEX_NAME}, and no committed step-* directory); "
            "an interrupted save leaves no index"
        )
    raise NotCommittedError(f"{storage.location}: no such checkpoint or run directory")


def committed_steps(run_dir: str) -> list[tuple[int, Storage]]:
    """``(step, storage)`` of every committed ``step-*`` checkpoint in a run directory, oldest first."""
    storage = open_storage(run_dir)
    out = []
    for name in storage.listdir():
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            child = storage.child(name)
            if is_committed(child):
                out.append((int(name[len(STEP_PREFIX) :]), child))
    return sorted(out, key=lambda x: x[0])


class ReusedBuffer:
    """One host buffer that many boxes are read into in turn (``read_box(out=)``: an export's logical tensors, a
    diff's), grown to the largest: a new tensor per read has its pages faulted in anew each time (the kernel zeroing
    fresh memory), which was most of an export's system time. Viewed as a tensor (:meth:`get`) or as bytes
    (:meth:`get_bytes`, for a reader without torch). ``reserve``: the size of the largest read to come, taken at
    the first read, where the caller knows it: growing by steps faults every step's pages in anew."""

    def __init__(self, reserve: int = 0) -> None:
        self._bytes = np.empty(0, dtype=np.uint8)
        self._reserve = reserve

    def get_bytes(self, nbytes: int) -> np.ndarray:
        """The buffer's first ``nbytes`` bytes (its contents are the last read's)."""
        if len(self._bytes) < nbytes:
            self._bytes = np.empty(max(nbytes, self._reserve), dtype=np.uint8)
        return self._bytes[:nbytes]

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the buffer (its contents are the last read's)."""
        import torch

        n = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(self.get_bytes(n)).view(dtype).view(shape)


class CheckpointReader:
    """Read access to one committed checkpoint: its index, its pieces, and whole tensors."""

    def __init__(self, location: str | os.PathLike[str]):
        self.storage = resolve(location)
        try:
            raw = self.storage.read_bytes(INDEX_NAME)
        except FileNotFoundError:
            raise NotCommittedError(f"{self.storage.path(INDEX_NAME)}: index disappeared while opening") from None
        self.index = Index.loads(raw, self.storage.path(INDEX_NAME))
        self.backend: Backend = get_backend(self.index.backend)
        self._pieces: list[PieceRef] | None = None
        self._by_tensor: dict[str, list[PieceRef]] | None = None

    @property
    def location(self) -> str:
        return self.storage.location

    def pieces(self, tensors: Iterable[str] | None = None, writers: Iterable[int] | None = None) -> list[PieceRef]:
        """Stored pieces, optionally only of some tensors and some writers' files."""
        if tensors is None and writers is None:
            if self._pieces is None:
                self._pieces = self.backend.list_pieces(self.storage, self.index)
            return self._pieces
        return self.backend.list_pieces(
            self.storage,
            self.index,
            None if tensors is None else set(tensors),
            None if writers is None else set(writers),
        )

    def pieces_of(self, name: str) -> list[PieceRef]:
        """The stored pieces of tensor ``name`` (grouped once for the reader: a whole-model read asks per tensor)."""
        if self._by_tensor is None:
            by: dict[str, list[PieceRef]] = {}
            for r in self.pieces():
                by.setdefault(r.tensor, []).append(r)
            self._by_tensor = by
        return self._by_tensor.get(name, [])

    def read_piece(self, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.backend.read_piece(self.storage, ref, rows)

    def open_reader(self) -> PieceReader:
        """A read session for many row reads (the resharder's chunk cache); close it when done."""
        return self.backend.open_reader(self.storage)

    def read_box(
        self,
        name: str,
        box: Box,
        refs: Sequence[PieceRef] | None = None,
        *,
        out: torch.Tensor | None = None,
        session: PieceReader | None = None,
    ) -> torch.Tensor:
        """Assemble ``box`` of tensor ``name`` from the stored pieces, reading only the rows that overlap it; into
        ``out`` where given (a contiguous tensor of the box's shape and the tensor's dtype: a caller's reused
        buffer, whose pages are not faulted in again for every tensor), else into a new tensor.

        ``session`` (from :meth:`open_reader`, for a caller reading many boxes): the rows are read through it,
        mapped where the storage maps its files (checksums computed over the page cache, then the box's bytes
        copied out of it once, so the result is never backed by the file), instead of read into fresh memory
        per piece and copied from there."""
        import torch

        entry = self.tensor(name)
        dtype = dtypes.to_torch(entry.dtype)
        if out is None:
            out = torch.empty(box.shape, dtype=dtype)
        elif tuple(out.shape) != box.shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(
                f"read_box: out is {out.dtype} {list(out.shape)}, the box of {name!r} needs a contiguous {dtype} "
                f"{list(box.shape)}"
            )
        if refs is None:
            refs = self.pieces_of(name)
        filled = 0
        for ref in refs:
            if ref.tensor != name:
                continue
            overlap = ref.box.intersect(box)
            if overlap is None:
                continue
            rel = overlap.relative_to(ref.box)
            if ref.box.ndim:
                r0, r1 = rel.offsets[0], rel.offsets[0] + rel.shape[0]
                src = self._read_rows(ref, r0, r1, session)[(slice(None),) + rel.slices()[1:]]
            else:
                src = self.read_piece(ref)
            out[overlap.relative_to(box).slices()] = src
            del src  # freed before the next piece is read: a box's reads are held one at a time
            filled += overlap.numel
        self._check_cover(name, box, filled)
        return out

    def _read_rows(self, ref: PieceRef, lo: int, hi: int, session: PieceReader | None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a stored piece, verified: mapped through ``session`` where it maps, else read."""
        if session is None:
            return self.read_piece(ref, (lo, hi))
        mapped = session.map_rows(ref, lo, hi)
        return mapped if mapped is not None else session.read_rows(ref, lo, hi)

    def read_tensor(
        self, name: str, *, out: torch.Tensor | None = None, session: PieceReader | None = None
    ) -> torch.Tensor:
        """The whole tensor ``name`` (into ``out`` and through ``session`` where given: see :meth:`read_box`)."""
        entry = self.tensor(name)
        return self.read_box(name, Box.full(entry.shape), out=out, session=session)

    def read_bytes(self, name: str, out: np.ndarray, session: PieceReader) -> bool:
        """The whole tensor ``name`` as its bytes in C order, into ``out`` (a contiguous uint8 array of exactly its
        bytes), every stored piece's checksum blocks verified, without torch: what an export that moves bytes
        unchanged reads with. Pieces that fill a contiguous range of the tensor are read straight into it; the
        others (a TP rank's columns) are verified over a mapping of their file and copied into place once.
        False (``out`` partly filled) where ``session`` cannot (a storage that neither reads into memory nor maps
        its files): the caller reads through :meth:`read_tensor` instead."""
        entry = self.tensor(name)
        if out.dtype != np.uint8 or out.ndim != 1 or len(out) != entry.nbytes or not out.flags.c_contiguous:
            raise ValueError(
                f"read_bytes: out must be a contiguous uint8 array of the {entry.nbytes} bytes of {name!r}"
            )
        into = getattr(session, "read_pieces_into", None)
        mapped_rows = getattr(session, "map_rows_bytes", None)
        if into is None or mapped_rows is None:
            return False
        item = dtypes.itemsize(entry.dtype)
        view = byte_view(out, entry.shape, item)
        filled = 0
        for ref in self.pieces_of(name):
            region = _byte_region(ref.box, item)
            dest = view[region]
            if dest.flags.c_contiguous:
                if not into([ref], [dest.reshape(-1).data]):
                    return False
            else:
                found = mapped_rows(ref, 0, ref.box.shape[0])
                if found is None:
                    return False
                mapped, offset, nbytes = found
                src = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=offset)
                dest[...] = src.reshape(dest.shape)
                del src, mapped
            filled += ref.box.numel
        self._check_cover(name, Box.full(entry.shape), filled)
        return True

    def _check_cover(self, name: str, box: Box, filled: int) -> None:
        """Refuse a read whose pieces filled ``filled`` of the ``box.numel`` elements asked for."""
        if filled != box.numel:
            raise CheckpointIndexError(
                f"{self.location}: stored pieces of {name!r} cover {filled} of the {box.numel} elements of box "
                f"{box.to_json()}; the checkpoint is incomplete"
            )

    def tensor(self, name: str) -> TensorEntry:
        try:
            return self.index.tensors[name]
        except KeyError:
            raise CheckpointIndexError(f"{self.location}: no tensor named {name!r} in this checkpoint") from None


def verify(reader: CheckpointReader, on_piece: Callable[[PieceRef], None] | None = None) -> list[str]:
    """Check every data file, every piece checksum and the exact cover of every tensor.

    Returns the list of problems (empty when the checkpoint is sound). Problems with one piece do not stop the
    check of the others, so one run names every damaged file and tensor.
    """
    problems: list[str] = []
    by_tensor: dict[str, list[Box]] = {name: [] for name in reader.index.tensors}
    refs: list[PieceRef] = []
    unreadable = 0
    for entry in reader.index.files.values():
        try:
            refs.extend(reader.backend.list_pieces(reader.storage, replace_files(reader.index, [entry])))
        except MoeckptError as e:
            problems.append(str(e))
            unreadable += 1
    for ref in refs:
        by_tensor[ref.tensor].append(ref.box)
        try:
            reader.read_piece(ref)
        except MoeckptError as e:
            problems.append(str(e))
        if on_piece is not None:
            on_piece(ref)
    cover = []
    for name, boxes in by_tensor.items():
        problem = covers_exactly_once(reader.index.tensors[name].shape, boxes)
        if problem is not None:
            cover.append(f"{reader.location}: tensor {name!r}: {problem}")
    if cover and unreadable:
        # Every tensor with a piece in an unreadable file is incomplete: one line, not one per tensor.
        cover = [
            f"{reader.location}: {len(cover)} tensor(s) incomplete because of the unreadable file(s) above, "
            f"e.g. {cover[0].split(': ', 1)[1]}"
        ]
    return problems + cover


def replace_files(index: Index, files: list[FileEntry]) -> Index:
    return replace(index, files={f.path: f for f in files})


def byte_view(flat: np.ndarray, shape: tuple[int, ...], itemsize: int) -> np.ndarray:
    """A tensor's bytes ``flat`` viewed with its shape, the last dimension counted in bytes (a 0-d tensor: its
    bytes in one row): any dtype's regions, and any cut along the other dimensions, are then slices of a uint8
    array."""
    return flat.reshape(tuple(shape[:-1]) + (shape[-1] * itemsize,) if shape else (itemsize,))


def _byte_region(box: Box, itemsize: int) -> tuple[slice, ...]:
    """Box ``box`` as slices of :func:`byte_view`."""
    if not box.ndim:
        return (slice(0, itemsize),)
    slices = list(box.slices())
    last = slices[-1]
    slices[-1] = slice(last.start * itemsize, last.stop * itemsize)
    return tuple(slices)
