"""The zarr v3 backend: one zarr array per logical tensor, its chunk grid aligned with the writers' pieces.

A checkpoint directory (``<t>`` is a tensor name such as ``exp_avg/layers.0.mlp.router.weight``; its ``/`` make
zarr groups)::

    moeckpt.json          the index, written last: the commit
    zarr.json             the root group
    exp_avg/zarr.json     one group per name prefix
    <t>/zarr.json         the array: shape, stored dtype, chunk grid, codecs; the real dtype in its attributes
    <t>/c/<i>/<j>/...     one object per grid cell, written whole by exactly one writer

Why two writers can never touch one object: :meth:`ZarrBackend.prepare` sees every piece of every tensor before
anyone writes, and takes as the chunk (shard) size of each dimension the gcd of the piece boundaries inside the
tensor (the last chunk may overhang the array's end, as zarr allows; it is stored padded). Every piece is then a
union of whole grid cells and every cell lies in exactly one piece; a piece has one writer, so every object has
one writer, who writes it once, whole, without reading it first (Megatron's zarr backend read-modified-wrote
shared chunks: slow, and optimizer state was lost when writers collided).

A cell of more than :data:`INNER_CHUNK_BYTES` is stored with the zarr sharding codec: inner chunks of at most that
size (split along dim 0 first), each followed by its crc32c, behind a crc32c-protected index at the start of the
object, so a reader fetches the index plus only the inner chunks of the rows it needs and verifies each. A smaller
cell is one plain chunk: its bytes, then their crc32c. Both are standard zarr v3: ``zarr.open_array`` reads any
tensor. With ``compress="blosc-zstd"`` (``--compress``) every (inner) chunk is compressed with zarr v3's standard
``blosc`` codec (zstd, byte shuffle at the element size), its crc32c taken of the decoded bytes and of the
compressed ones; the array document records the codecs, so zarr-python and tensorstore decode it unaided, and a
reader learns each array's codecs from its own document. bf16 and fp8 are stored as uint16/uint8 (zarr has no
such dtypes), the real dtype in the array attribute
``moeckpt.dtype``. The index lists the ``zarr.json`` documents (size and xxh3 checksum), so it grows with the
number of tensors, never with the number of pieces.

This module chooses each tensor's grid from the writers' pieces (:func:`plan_array`) and is the Backend; an array's
documents and cells are :mod:`.zarr_array`'s, a cell's bytes (codecs, crc32c, reads by rows) :mod:`.zarr_cells`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

import torch

from .. import dtypes
from ..box import Box, covers_exactly_once
from ..checksum import checksum
from ..compression import BLOSC_ZSTD, NONE
from ..errors import CheckpointIndexError, DataFileError
from ..index import INDEX_NAME, FileEntry, Index, TensorEntry, check_relative_path
from ..pieces import CHECKSUM_BLOCK_BYTES, Piece, PieceRef
from ..storage import Storage
from .base import BackendBase
from .chunk_codec import host_cores
from .zarr_array import META_NAME, ArrayPlan, array_of, cell_refs, chunk_array, group_metadata_bytes, meta_path_of
from .zarr_cells import encode_cell, missing_object, read_piece
from .zarr_reader import ZarrReader

NAME = "zarr"
#: the largest inner chunk (and the largest cell stored without the sharding codec): the unit a reader fetches
#: and verifies, as the safetensors backend's checksum blocks.
INNER_CHUNK_BYTES = CHECKSUM_BLOCK_BYTES
#: concurrent object writes per writer (object stores need many requests in flight to reach their bandwidth).
WRITE_THREADS_LOCAL = 4
WRITE_THREADS_REMOTE = 16
#: a compressing writer stores its cells in up to one thread per core (at most this many): a cell of one chunk is
#: encoded in its writer's thread, the inner chunks of a shard on the codec pool (:mod:`.chunk_codec`), both off
#: the interpreter lock, so the encoding of some cells overlaps the writes of others.
COMPRESS_THREADS_MAX = 16
_PLANS_KEPT = 4

T = TypeVar("T")


def grid_shape(shape: Sequence[int], boxes: Iterable[Box]) -> tuple[int, ...]:
    """Per dimension, the gcd of the box boundaries inside the tensor: the coarsest regular grid of which every
    box is a union of cells.

    The tensor's end is not a boundary the grid must hit: zarr lets the last chunk of a dimension overhang the
    array. That is what keeps ZeRO's ``ceil(n / dp)``-row parts one chunk each when dp does not divide n (with
    the end counted, rows 683/1366/2048 would give 1-row chunks).
    """
    out = []
    boxes = list(boxes)
    for d, n in enumerate(shape):
        g = 0
        for b in boxes:
            for edge in (b.offsets[d], b.end[d]):
                if 0 < edge < n:
                    g = math.gcd(g, edge)
        out.append(g or max(n, 1))
    return tuple(out)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    for k in range(1, math.isqrt(n) + 1):
        if n % k == 0:
            for d in (k, n // k):
                if best < d <= limit:
                    best = d
    return best


def inner_chunk_shape(shard: Sequence[int], itemsize: int, limit: int | None = None) -> tuple[int, ...] | None:
    """Inner chunks of at most ``limit`` bytes that tile ``shard``, split along dim 0 first; ``None`` if one fits.

    Splitting the leading dims keeps the inner chunks of a row range contiguous in the shard (C order), so a
    reader of rows ``[r0, r1)`` fetches one byte range. ``limit`` defaults to :data:`INNER_CHUNK_BYTES`.
    """
    limit = INNER_CHUNK_BYTES if limit is None else limit
    if math.prod(shard) * itemsize <= limit or not shard:
        return None
    inner = list(shard)
    for d in range(len(shard)):
        rest = math.prod(shard[d + 1 :]) * itemsize
        if rest <= limit:
            inner[d] = _largest_divisor_at_most(shard[d], max(1, limit // rest))
            return tuple(inner)
        inner[d] = 1
    return tuple(inner)


def plan_array(entry: TensorEntry, boxes: Sequence[Box], compress: str = NONE) -> ArrayPlan:
    """The storage plan of one tensor from every piece written of it (which must tile it exactly once), its
    chunks compressed as ``compress`` says."""
    problem = covers_exactly_once(entry.shape, boxes)
    if problem is not None:
        raise CheckpointIndexError(
            f"tensor {entry.name!r}: {problem}; the zarr backend stores every element exactly once"
        )
    shard = grid_shape(entry.shape, boxes)
    inner = inner_chunk_shape(shard, dtypes.itemsize(entry.dtype)) if entry.shape else None
    return ArrayPlan(entry.name, entry.shape, entry.dtype, shard, inner, compress)


def write_threads(is_local: bool, compress: str) -> int:
    """Threads that encode and write one writer's cells: raw, as many as the storage wants requests in flight;
    compressed, at least that many and up to one per core (encoding is the work there)."""
    threads = WRITE_THREADS_LOCAL if is_local else WRITE_THREADS_REMOTE
    if compress != NONE:
        threads = max(threads, min(COMPRESS_THREADS_MAX, host_cores()))
    return threads


def check_tensor_names(names: Collection[str]) -> None:
    """Refuse names that cannot be zarr node paths, or that make one array another's parent."""
    for name in names:
        check_relative_path(name, f"tensor {name!r}")
        parts = name.split("/")
        if any(p.startswith("__") or p == META_NAME for p in parts) or parts[0] == INDEX_NAME:
            raise CheckpointIndexError(
                f"tensor {name!r} cannot be a zarr array path (no part may start with '__' or be {META_NAME!r}, and "
                f"it may not be named {INDEX_NAME!r}); rename it or save with --format safetensors"
            )
    arrays = set(names)
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            prefix = "/".join(parts[:i])
            if prefix in arrays:
                raise CheckpointIndexError(
                    f"tensors {prefix!r} and {name!r}: in zarr one would have to be both an array and a group; "
                    "rename one or save with --format safetensors"
                )


def group_paths(names: Iterable[str]) -> list[str]:
    """The groups implied by tensor names: the root ``""`` and every proper prefix."""
    groups = {""}
    for name in names:
        parts = name.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(groups)


def _run(fn: Callable[[T], Any], items: Sequence[T], threads: int) -> None:
    if len(items) <= 1 or threads <= 1:
        for it in items:
            fn(it)
        return
    pool = ThreadPoolExecutor(max_workers=min(threads, len(items)))
    try:
        for fut in as_completed([pool.submit(fn, it) for it in items]):
            fut.result()  # the first failure ends the whole batch: pending writes are cancelled, not attempted
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class ZarrBackend(BackendBase):
    """One zarr v3 array per tensor; see the module docstring for the layout and why writers never collide.

    In one process (``save_pieces``) :meth:`prepare` keeps the plan in memory for :meth:`write` and
    :meth:`finish`. In a multi-process save, call :meth:`prepare` on one rank before the others write: a writer
    that has no plan in memory reads the ``zarr.json`` of each tensor it writes (or call :meth:`plan` on every
    rank, which is pure, to skip those reads).
    """

    name = NAME
    files_summary: str | None = (
        "{files} zarr.json metadata documents ({meta}) + {chunks} chunk objects ({data}), one array per tensor"
    )
    #: a writer's pieces may be stored in several :meth:`write` calls: every grid cell is its own object, named by
    #: tensor and cell, so a batch never depends on the rest of the writer's pieces (the offline resharder streams).
    piecewise_writes = True
    #: pieces are joined from their slabs, then cut into cells (write_stream_by_pieces).
    streams_slabs = False
    #: writers stay threads: each stores its cells through a pool of writer threads of its own (see _run), whose
    #: I/O releases the interpreter lock; forked writers are built for one streamed file per writer.
    fork_safe = False
    #: cells of a grid, not placements: readers list them from the array documents.
    stores_placements = False
    #: the compression settings it writes (:mod:`~moeckpt.formats.compression`); readers decode any of them.
    compressions = (NONE, BLOSC_ZSTD)

    def __init__(self, compress: str = NONE) -> None:
        self._plans: dict[str, dict[str, ArrayPlan]] = {}
        #: how the arrays it plans are compressed (set by :func:`~moeckpt.formats.backend.get_backend`).
        self.compress = compress

    # -- writing -----------------------------------------------------------------------------------------
    def plan(
        self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]
    ) -> dict[str, ArrayPlan]:
        """Compute (without I/O) and remember the storage plan of every tensor; every rank gets the same."""
        check_tensor_names(tensors)
        plans = {name: plan_array(entry, boxes.get(name, []), self.compress) for name, entry in tensors.items()}
        self._remember(storage.location, plans)
        return plans

    def _remember(self, location: str, plans: dict[str, ArrayPlan]) -> dict[str, ArrayPlan]:
        # A trainer keeps one backend for the whole run: remember only the last few save locations.
        self._plans.pop(location, None)
        self._plans[location] = plans
        while len(self._plans) > _PLANS_KEPT:
            self._plans.pop(next(iter(self._plans)))
        return plans

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        plans = self.plan(storage, tensors, boxes)
        docs = [(meta_path_of(g), group_metadata_bytes(g)) for g in group_paths(tensors)]
        docs += [(p.meta_path, p.metadata_bytes()) for p in plans.values()]
        threads = WRITE_THREADS_LOCAL if storage.is_local else WRITE_THREADS_REMOTE
        _run(lambda d: storage.write_parts(d[0], [d[1]]), docs, threads)

    def _plans_for(
        self, storage: Storage, tensors: dict[str, TensorEntry], names: Iterable[str]
    ) -> dict[str, ArrayPlan]:
        known = self._plans.get(storage.location)
        if known is None:
            known = self._remember(storage.location, {})
        todo = sorted(set(names) - set(known))
        if todo:
            try:
                raws = storage.read_ranges([(f"{t}/{META_NAME}", None, None) for t in todo])
            except FileNotFoundError:
                raise DataFileError(
                    f"{storage.location}: zarr array documents are missing; call prepare() before any writer writes"
                ) from None
            for t, raw in zip(todo, raws):
                known[t] = ArrayPlan.from_metadata(bytes(raw), tensors[t], storage.path(f"{t}/{META_NAME}"))
        return known

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]:
        """Write every grid cell of ``pieces`` as its own object; the index lists none of them (see finish)."""
        # Objects are named by tensor and cell, not by writer: the grid already keeps writers apart. The cells are
        # written one after another whatever ``threads`` says (their uploads have their own concurrency).
        del writer, threads
        live = [p for p in pieces if not p.box.is_empty()]
        plans = self._plans_for(storage, tensors, {p.tensor for p in live})
        jobs: list[tuple[ArrayPlan, Box, torch.Tensor]] = []
        for p in live:
            entry = tensors[p.tensor]
            if dtypes.from_torch(p.data.dtype) != entry.dtype:
                raise ValueError(f"piece of {p.tensor!r} has dtype {p.data.dtype}, the index says {entry.dtype}")
            plan = plans[p.tensor]
            data = p.data.detach().cpu()
            for cell in plan.cells(p.box):
                jobs.append((plan, cell, data[cell.relative_to(p.box).slices()]))

        compress = BLOSC_ZSTD if any(plan.compress != NONE for plan, _, _ in jobs) else NONE

        def put(job: tuple[ArrayPlan, Box, torch.Tensor]) -> None:
            plan, cell, data = job
            storage.write_parts(plan.key(cell), encode_cell(plan, data))

        _run(put, jobs, write_threads(storage.is_local, compress))
        return []

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        """Add the index entries of every ``zarr.json`` (groups and arrays) to what the writers returned."""
        plans = self._plans.get(storage.location, {})
        docs: dict[str, bytes] = {meta_path_of(g): group_metadata_bytes(g) for g in group_paths(tensors)}
        if set(plans) >= set(tensors):
            docs.update((plans[t].meta_path, plans[t].metadata_bytes()) for t in tensors)
        else:  # prepared by another process: take the documents as stored
            paths = [f"{t}/{META_NAME}" for t in sorted(tensors)]
            try:
                raws = storage.read_ranges([(p, None, None) for p in paths])
            except FileNotFoundError:
                raise DataFileError(
                    f"{storage.location}: zarr array documents are missing; was prepare() run?"
                ) from None
            docs.update(zip(paths, (bytes(r) for r in raws)))
        return list(files) + [FileEntry(path=p, size=len(b), checksum=checksum(b)) for p, b in sorted(docs.items())]

    # -- reading -----------------------------------------------------------------------------------------
    def list_pieces(
        self,
        storage: Storage,
        index: Index,
        tensors: Collection[str] | None = None,
        writers: Collection[int] | None = None,
    ) -> list[PieceRef]:
        """One piece per stored cell of the arrays listed in ``index.files``.

        zarr objects are named by tensor and cell, not by writer, so ``writers`` cannot narrow the result: all
        pieces of the requested tensors are returned. Group documents listed in ``index.files`` are checked
        against their size and checksum and yield no pieces.
        """
        del writers
        entries = [f for f in index.files.values() if tensors is None or array_of(f.path) in tensors]
        if not entries:
            return []
        try:
            raws = storage.read_ranges([(f.path, None, None) for f in entries])
        except FileNotFoundError:
            for f in entries:
                if not storage.exists(f.path):
                    raise missing_object(storage, f.path, "zarr document") from None
            raise
        refs: list[PieceRef] = []
        for f, raw in zip(entries, raws):
            where = storage.path(f.path)
            if len(raw) != f.size or checksum(raw) != f.checksum:
                raise DataFileError(
                    f"{where}: zarr document differs from the index (size {len(raw)} vs {f.size}, or checksum): it "
                    "is corrupt or was replaced"
                )
            name = array_of(f.path)
            entry = index.tensors.get(name) if name is not None else None
            if entry is None:
                continue  # a group document
            plan = ArrayPlan.from_metadata(bytes(raw), entry, where)
            if plan.compress != index.compress:
                # the index's compress decides every array's codecs (docs/format.md): a compressed array under a
                # raw index (or the reverse) is not what any moeckpt wrote, and an older reader would misread it
                raise DataFileError(
                    f"{where}: array of tensor {name!r} is stored with compression {plan.compress!r}, the index "
                    f"says {index.compress!r}"
                )
            refs.extend(cell_refs(plan))
        return refs

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_piece(storage, ref, rows)

    def open_reader(self, storage: Storage) -> ZarrReader:
        """A session that reads rows straight into the caller's memory where the storage reads directly."""
        return ZarrReader(self, storage)

    def top_level_names(self, writers: int, tensors: Collection[str]) -> set[str] | None:
        """The group's ``zarr.json`` and each tensor's first path component (its array, or the group holding it)."""
        return {META_NAME} | {name.split("/", 1)[0] for name in tensors}

    def stored_objects(self, storage: Storage, index: Index) -> dict[str, int]:
        """The documents the index lists, plus the chunk (shard) objects of its arrays, from one listing of the
        storage (the index does not list them: it grows with tensors, not pieces)."""
        out = {f.path: f.size for f in index.files.values()}
        for path, size in storage.list_files().items():
            if path not in out and chunk_array(path, index.tensors) is not None:
                out[path] = size
        return out
