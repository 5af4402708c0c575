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
tensor. bf16 and fp8 are stored as uint16/uint8 (zarr has no such dtypes), the real dtype in the array attribute
``moeckpt.dtype``. The index lists the ``zarr.json`` documents (size and xxh3 checksum), so it grows with the
number of tensors, never with the number of pieces.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from itertools import product
from typing import Any, TypeVar

import google_crc32c
import numpy as np
import torch

from .. import dtypes
from ..box import Box, covers_exactly_once
from ..checksum import checksum
from ..errors import CheckpointIndexError, ChecksumMismatchError, DataFileError
from ..index import INDEX_NAME, FileEntry, Index, TensorEntry, check_relative_path
from ..pieces import CHECKSUM_BLOCK_BYTES, Piece, PieceRef, tensor_bytes
from ..storage import Storage
from .base import BackendBase

NAME = "zarr"
META_NAME = "zarr.json"
#: the largest inner chunk (and the largest cell stored without the sharding codec): the unit a reader fetches
#: and verifies, as the safetensors backend's checksum blocks.
INNER_CHUNK_BYTES = CHECKSUM_BLOCK_BYTES
#: a hostile or broken array document must not make a reader enumerate billions of cells.
MAX_CELLS_PER_ARRAY = 10_000_000
#: concurrent object writes per writer (object stores need many requests in flight to reach their bandwidth).
WRITE_THREADS_LOCAL = 4
WRITE_THREADS_REMOTE = 16
_PLANS_KEPT = 4

#: dtypes zarr lacks, stored as the unsigned integer of the same width.
_STORED_AS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
_BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
_CRC_CODEC = {"name": "crc32c"}
_CRC_BYTES = 4
_INDEX_ENTRY_BYTES = 16  # (offset, nbytes) as two little-endian uint64

T = TypeVar("T")


def stored_dtype(dtype: str) -> str:
    """The zarr ``data_type`` a moeckpt dtype is stored as."""
    return _STORED_AS.get(dtype, dtype)


def crc32c(data: bytes | bytearray | memoryview) -> bytes:
    """The 4-byte little-endian crc32c the zarr ``crc32c`` codec appends."""
    return struct.pack("<I", google_crc32c.value(np.frombuffer(data, dtype=np.uint8)))


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


@dataclass(frozen=True)
class ArrayPlan:
    """How one tensor is stored: its grid cell (one object each) and the inner chunks of a cell."""

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    #: the zarr chunk grid: one cell = one stored object = part of exactly one piece.
    shard: tuple[int, ...]
    #: inner chunk shape within a cell (sharding codec), or ``None`` when a cell is one plain chunk.
    inner: tuple[int, ...] | None

    @property
    def meta_path(self) -> str:
        return f"{self.tensor}/{META_NAME}"

    @property
    def cell_bytes(self) -> int:
        return math.prod(self.shard) * dtypes.itemsize(self.dtype)

    def key(self, cell: Box) -> str:
        """The object of a grid cell (zarr's default chunk key encoding, ``/`` separator)."""
        return "/".join([self.tensor, "c", *(str(o // s) for o, s in zip(cell.offsets, self.shard))])

    def cells(self, within: Box | None = None) -> Iterator[Box]:
        """The grid cells of ``within`` (the whole tensor by default), which must be a union of cells."""
        box = within if within is not None else Box.full(self.shape)
        ranges = []
        for d, s in enumerate(self.shard):
            lo, hi = box.offsets[d], box.end[d]
            if lo % s or (hi % s and hi != self.shape[d]):
                raise CheckpointIndexError(
                    f"tensor {self.tensor!r}: piece {box.to_json()} is not aligned to the zarr chunk grid "
                    f"{list(self.shard)}; prepare() was given other pieces than the writers write"
                )
            ranges.append(range(lo, hi, s))
        for offs in product(*ranges):
            yield Box(tuple(offs), tuple(min(s, n - o) for o, s, n in zip(offs, self.shard, self.shape)))

    def stored_shape(self, cell: Box) -> tuple[int, ...] | None:
        """The padded shape an edge cell is stored with, or ``None`` when the cell is a whole chunk."""
        return None if cell.shape == self.shard else self.shard

    def n_cells(self) -> int:
        return math.prod(-(-n // s) for n, s in zip(self.shape, self.shard))

    def metadata(self) -> dict[str, Any]:
        kind = dtypes.to_torch(self.dtype)
        fill: Any = (
            False if self.dtype == "bool" else (0.0 if kind.is_floating_point and self.dtype not in _STORED_AS else 0)
        )
        if self.inner is None:
            codecs: list[dict[str, Any]] = [_BYTES_CODEC, _CRC_CODEC]
        else:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.inner),
                        "codecs": [_BYTES_CODEC, _CRC_CODEC],
                        "index_codecs": [_BYTES_CODEC, _CRC_CODEC],
                        "index_location": "start",
                    },
                }
            ]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": stored_dtype(self.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": codecs,
            "attributes": {"moeckpt": {"dtype": self.dtype, "format_version": 1}},
        }

    def metadata_bytes(self) -> bytes:
        return json.dumps(self.metadata(), indent=2).encode()

    @classmethod
    def from_metadata(cls, raw: bytes, entry: TensorEntry, where: str) -> ArrayPlan:
        """Parse an array document written by :meth:`metadata_bytes` and check it against the index entry."""
        try:
            doc = json.loads(raw.decode("utf-8"))
            shard = tuple(int(s) for s in doc["chunk_grid"]["configuration"]["chunk_shape"])
            codecs = doc["codecs"]
            inner = None
            if codecs and codecs[0].get("name") == "sharding_indexed":
                inner = tuple(int(s) for s in codecs[0]["configuration"]["chunk_shape"])
            shape = tuple(doc["shape"])
            dtype = doc["attributes"]["moeckpt"]["dtype"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, IndexError):
            raise DataFileError(f"{where}: not a zarr array document written by moeckpt") from None
        if shape != entry.shape or dtype != entry.dtype:
            raise DataFileError(
                f"{where}: array has shape {list(shape)} and dtype {dtype}, the index says {list(entry.shape)} "
                f"{entry.dtype} for tensor {entry.name!r}"
            )
        if (
            len(shard) != len(shape)
            or any(s < 1 for s in shard)
            or any(s > max(n, 1) for s, n in zip(shard, shape))
            or (inner is not None and (len(inner) != len(shard) or any(i < 1 or s % i for i, s in zip(inner, shard))))
        ):
            raise DataFileError(
                f"{where}: chunk grid {list(shard)} / inner chunks {inner} do not fit shape {list(shape)}"
            )
        plan = cls(entry.name, entry.shape, entry.dtype, shard, inner)
        if plan.metadata_bytes() != bytes(raw):
            raise DataFileError(
                f"{where}: array document is not in the layout moeckpt writes (codecs or encoding differ)"
            )
        if plan.n_cells() > MAX_CELLS_PER_ARRAY:
            raise DataFileError(f"{where}: chunk grid {list(shard)} makes more than {MAX_CELLS_PER_ARRAY} objects")
        return plan


def plan_array(entry: TensorEntry, boxes: Sequence[Box]) -> ArrayPlan:
    """The storage plan of one tensor from every piece written of it (which must tile it exactly once)."""
    problem = covers_exactly_once(entry.shape, boxes)
    if problem is not None:
        raise CheckpointIndexError(
            f"tensor {entry.name!r}: {problem}; the zarr backend stores every element exactly once"
        )
    shard = grid_shape(entry.shape, boxes)
    inner = inner_chunk_shape(shard, dtypes.itemsize(entry.dtype)) if entry.shape else None
    return ArrayPlan(entry.name, entry.shape, entry.dtype, shard, inner)


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


def group_metadata_bytes(path: str) -> bytes:
    attrs = {"moeckpt": {"index": INDEX_NAME, "format_version": 1}} if path == "" else {}
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}, indent=2).encode()


def _meta_path(group_or_array: str) -> str:
    return f"{group_or_array}/{META_NAME}" if group_or_array else META_NAME


def encode_cell(plan: ArrayPlan, data: torch.Tensor) -> list[bytes | memoryview]:
    """The bytes of one cell's object, as parts to write back to back (views of ``data`` where possible).

    A cell at the array's end (smaller than the chunk) is padded with zeros (the fill value) to the chunk shape.
    """
    if tuple(data.shape) != plan.shard:
        padded = torch.zeros(plan.shard, dtype=data.dtype)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    if plan.inner is None:
        raw = tensor_bytes(data.reshape(-1))  # reshape: tensor_bytes cannot view a 0-d tensor as bytes
        return [raw, crc32c(raw)]
    grid = tuple(s // i for s, i in zip(plan.shard, plan.inner))
    n = math.prod(grid)
    chunk = math.prod(plan.inner) * dtypes.itemsize(plan.dtype) + _CRC_BYTES
    head = n * _INDEX_ENTRY_BYTES + _CRC_BYTES
    index = np.empty((n, 2), dtype="<u8")
    index[:, 0] = head + np.arange(n, dtype=np.uint64) * chunk
    index[:, 1] = chunk
    index_raw = index.tobytes()
    parts: list[bytes | memoryview] = [index_raw, crc32c(index_raw)]
    for coords in np.ndindex(*grid):  # C order, as the index lists them
        raw = tensor_bytes(data[tuple(slice(c * i, (c + 1) * i) for c, i in zip(coords, plan.inner))])
        parts += [raw, crc32c(raw)]
    return parts


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


def _missing(storage: Storage, relpath: str, what: str) -> DataFileError:
    return DataFileError(
        f"{storage.path(relpath)}: {what} is missing (listed in the index); the checkpoint is incomplete"
    )


def read_piece(storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read one cell, or rows ``[r0, r1)`` of its dim 0, verifying the crc32c of every chunk read."""
    box_shape = tuple(ref.box.shape)
    r0, r1 = rows if rows is not None and box_shape else (0, box_shape[0] if box_shape else 1)
    shape = ref.stored_shape or box_shape  # an edge cell is stored padded to the chunk shape
    data = _read_stored(storage, ref, shape, r0, r1)
    if shape == box_shape:
        return data
    # crop the padding: rows are already cut to [r0, r1); the other dims to the cell
    return data[(slice(None),) + tuple(slice(0, n) for n in box_shape[1:])]


def _read_stored(storage: Storage, ref: PieceRef, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of an object that stores an array of ``shape``, every chunk read verified."""
    where = storage.path(ref.file)
    torch_dtype = dtypes.to_torch(ref.dtype)
    item = dtypes.itemsize(ref.dtype)
    if ref.chunks is None:
        nbytes = math.prod(shape) * item
        try:
            (buf,) = storage.read_ranges([(ref.file, None, None)])
        except FileNotFoundError:
            raise _missing(storage, ref.file, f"chunk of tensor {ref.tensor!r}") from None
        if len(buf) != nbytes + _CRC_BYTES:
            raise DataFileError(
                f"{where}: chunk of tensor {ref.tensor!r} has {len(buf)} bytes, expected {nbytes + _CRC_BYTES}: "
                "the object is truncated or replaced"
            )
        _check_crc(buf, 0, nbytes, ref, where, "chunk")
        full = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        full = full.view(torch_dtype).reshape(shape)
        return full[r0:r1] if shape and (r0, r1) != (0, shape[0]) else full
    inner = ref.chunks
    grid = tuple(s // i for s, i in zip(shape, inner))
    n, per_band = math.prod(grid), math.prod(grid[1:])
    data_bytes = math.prod(inner) * item
    chunk = data_bytes + _CRC_BYTES
    head = n * _INDEX_ENTRY_BYTES + _CRC_BYTES
    b0, b1 = r0 // inner[0], -(-r1 // inner[0])
    out_rows = (b1 - b0) * inner[0]
    if r1 <= r0:
        return torch.empty((0,) + shape[1:], dtype=torch_dtype)
    k0, k1 = b0 * per_band, b1 * per_band
    try:
        if (k0, k1) == (0, n):  # the whole shard: one request instead of two
            (data,) = storage.read_ranges([(ref.file, None, None)])
            if len(data) != head + n * chunk:
                raise DataFileError(
                    f"{where}: shard of tensor {ref.tensor!r} has {len(data)} bytes, expected {head + n * chunk}: "
                    "the object is truncated or replaced"
                )
            index_raw, base = data[:head], head
        else:
            index_raw, data = storage.read_ranges(
                [(ref.file, 0, head), (ref.file, head + k0 * chunk, head + k1 * chunk)]
            )
            base = 0
    except FileNotFoundError:
        raise _missing(storage, ref.file, f"shard of tensor {ref.tensor!r}") from None
    if len(index_raw) != head or len(data) != base + (k1 - k0) * chunk:
        raise DataFileError(f"{where}: shard of tensor {ref.tensor!r} ends early: the object is truncated")
    _check_crc(index_raw, 0, head - _CRC_BYTES, ref, where, "shard index")
    index = np.frombuffer(bytes(index_raw[: head - _CRC_BYTES]), dtype="<u8").reshape(n, 2)
    want = head + np.arange(k0, k1, dtype=np.uint64) * chunk
    if not (np.array_equal(index[k0:k1, 0], want) and bool((index[k0:k1, 1] == chunk).all())):
        raise DataFileError(f"{where}: shard index of tensor {ref.tensor!r} is not in the layout moeckpt writes")
    out = torch.empty((out_rows,) + shape[1:], dtype=torch_dtype)
    for j in range(k1 - k0):
        off = base + j * chunk
        _check_crc(data, off, data_bytes, ref, where, f"inner chunk {k0 + j}")
        coords = np.unravel_index(k0 + j, grid)
        dst = (slice((int(coords[0]) - b0) * inner[0], (int(coords[0]) - b0 + 1) * inner[0]),) + tuple(
            slice(int(c) * i, (int(c) + 1) * i) for c, i in zip(coords[1:], inner[1:])
        )
        src = torch.frombuffer(data, dtype=torch.uint8, offset=off, count=data_bytes).view(torch_dtype)
        out[dst] = src.reshape(inner)
    lo = r0 - b0 * inner[0]
    return out[lo : lo + (r1 - r0)] if (lo, r1 - r0) != (0, out_rows) else out


def _check_crc(buf: bytearray, off: int, nbytes: int, ref: PieceRef, where: str, what: str) -> None:
    mv = memoryview(buf)
    got, stored = crc32c(mv[off : off + nbytes]), bytes(mv[off + nbytes : off + nbytes + _CRC_BYTES])
    if got != stored:
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch (crc32c) in {what} of tensor {ref.tensor!r} box {ref.box.to_json()} "
            f"(stored {stored.hex()}, computed {got.hex()}); the object is corrupt"
        )


class ZarrBackend(BackendBase):
    """One zarr v3 array per tensor; see the module docstring for the layout and why writers never collide.

    In one process (``save_pieces``) :meth:`prepare` keeps the plan in memory for :meth:`write` and
    :meth:`finish`. In a multi-process save, call :meth:`prepare` on one rank before the others write: a writer
    that has no plan in memory reads the ``zarr.json`` of each tensor it writes (or call :meth:`plan` on every
    rank, which is pure, to skip those reads).
    """

    name = NAME
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

    def __init__(self) -> None:
        self._plans: dict[str, dict[str, ArrayPlan]] = {}

    # -- writing -----------------------------------------------------------------------------------------
    def plan(
        self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]
    ) -> dict[str, ArrayPlan]:
        """Compute (without I/O) and remember the storage plan of every tensor; every rank gets the same."""
        check_tensor_names(tensors)
        plans = {name: plan_array(entry, boxes.get(name, [])) for name, entry in tensors.items()}
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
        docs = [(_meta_path(g), group_metadata_bytes(g)) for g in group_paths(tensors)]
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

        def put(job: tuple[ArrayPlan, Box, torch.Tensor]) -> None:
            plan, cell, data = job
            storage.write_parts(plan.key(cell), encode_cell(plan, data))

        _run(put, jobs, WRITE_THREADS_LOCAL if storage.is_local else WRITE_THREADS_REMOTE)
        return []

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        """Add the index entries of every ``zarr.json`` (groups and arrays) to what the writers returned."""
        plans = self._plans.get(storage.location, {})
        docs: dict[str, bytes] = {_meta_path(g): group_metadata_bytes(g) for g in group_paths(tensors)}
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
        entries = [f for f in index.files.values() if tensors is None or _array_of(f.path) in tensors]
        if not entries:
            return []
        try:
            raws = storage.read_ranges([(f.path, None, None) for f in entries])
        except FileNotFoundError:
            for f in entries:
                if not storage.exists(f.path):
                    raise _missing(storage, f.path, "zarr document") from None
            raise
        refs: list[PieceRef] = []
        for f, raw in zip(entries, raws):
            where = storage.path(f.path)
            if len(raw) != f.size or checksum(raw) != f.checksum:
                raise DataFileError(
                    f"{where}: zarr document differs from the index (size {len(raw)} vs {f.size}, or checksum): it "
                    "is corrupt or was replaced"
                )
            name = _array_of(f.path)
            entry = index.tensors.get(name) if name is not None else None
            if entry is None:
                continue  # a group document
            plan = ArrayPlan.from_metadata(bytes(raw), entry, where)
            refs.extend(_refs(plan))
        return refs

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_piece(storage, ref, rows)

    def stored_objects(self, storage: Storage, index: Index) -> dict[str, int]:
        """The documents the index lists, plus the chunk (shard) objects of its arrays, from one listing of the
        storage (the index does not list them: it grows with tensors, not pieces)."""
        out = {f.path: f.size for f in index.files.values()}
        for path, size in storage.list_files().items():
            if path not in out and chunk_array(path, index.tensors) is not None:
                out[path] = size
        return out


def chunk_array(path: str, tensors: Collection[str]) -> str | None:
    """The tensor whose chunk (or shard) object ``path`` is (``<tensor>/c/<i>/...``, or ``<tensor>/c`` for a 0-d
    array), else ``None``."""
    i = path.find("/c")
    while i != -1:
        rest = path[i + 2 :]
        if (rest == "" or rest.startswith("/")) and path[:i] in tensors:
            return path[:i]
        i = path.find("/c", i + 1)
    return None


def _array_of(path: str) -> str | None:
    """The tensor whose array document ``path`` is, or ``None`` for the root document."""
    if path == META_NAME or not path.endswith("/" + META_NAME):
        return None
    return path[: -len(META_NAME) - 1]


def _refs(plan: ArrayPlan) -> list[PieceRef]:
    item = dtypes.itemsize(plan.dtype)
    row_bytes = math.prod(plan.shard[1:]) * item
    band_rows = plan.inner[0] if plan.inner is not None else (plan.shard[0] if plan.shard else 1)
    out = []
    for cell in plan.cells():
        nbytes = cell.numel * item
        block = max(1, band_rows * row_bytes) if plan.shape else max(1, nbytes)
        out.append(
            PieceRef(
                plan.tensor, cell, plan.dtype, plan.key(cell), 0, nbytes, (), block, plan.inner, plan.stored_shape(cell)
            )
        )
    return out
