"""One grid cell's object of a zarr array: encoded with crc32c (one plain chunk, or inner chunks behind an index
with the sharding codec) and read back verified, whole or by rows of its dim 0.

A cell of more than :data:`~.zarr.INNER_CHUNK_BYTES` is stored with the sharding codec, each inner chunk followed
by its crc32c, behind a crc32c-protected index at the start of the object, so a reader fetches the index plus only
the inner chunks of the rows it needs; an edge cell is stored padded to the chunk shape (the fill value).

Compressed (``--compress blosc-zstd``), every (inner) chunk is its bytes and their crc32c, compressed together
with blosc, followed by the crc32c of the compressed bytes: the outer crc32c is checked before decoding, the inner
one after, so what a reader gets is verified, whatever the codec did. The shard index then gives each compressed
inner chunk's offset and length (the chunks back to back, in order), and a read of some rows decodes the whole
inner chunks that hold them.
"""

from __future__ import annotations

import ctypes
import math
import struct

import numpy as np
import torch
from numcodecs import blosc

from .. import dtypes
from ..compression import NONE
from ..errors import ChecksumMismatchError, DataFileError
from ..pieces import PieceRef, tensor_bytes
from ..storage import Storage
from .chunk_codec import blosc_compress, blosc_decompress_into, codec_map, crc32c
from .zarr_array import BLOSC_BLOCKSIZE, BLOSC_CLEVEL, BLOSC_CNAME, ArrayPlan

CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16  # (offset, nbytes) as two little-endian uint64
#: the header every blosc (1.x) frame starts with: version, versionlz, flags, typesize, then the decoded size,
#: the block size and the frame's own size as little-endian uint32.
BLOSC_HEADER_BYTES = 16


def compress_chunk(raw: memoryview, itemsize: int) -> list[bytes | memoryview]:
    """One compressed chunk as written: blosc of (``raw`` + its crc32c), then the crc32c of that frame."""
    framed = np.empty(len(raw) + CRC_BYTES, dtype=np.uint8)
    if len(raw):
        src = np.frombuffer(raw, dtype=np.uint8)
        ctypes.memmove(framed.ctypes.data, src.ctypes.data, len(raw))  # a foreign call: off the interpreter lock
    framed[len(raw) :] = np.frombuffer(crc32c(raw), dtype=np.uint8)
    frame = blosc_compress(framed, BLOSC_CNAME, BLOSC_CLEVEL, blosc.SHUFFLE, BLOSC_BLOCKSIZE, itemsize)
    return [frame, crc32c(frame)]


def encode_cell(plan: ArrayPlan, data: torch.Tensor) -> list[bytes | memoryview]:
    """The bytes of one cell's object, as parts to write back to back (views of ``data`` where possible).

    A cell at the array's end (smaller than the chunk) is padded with zeros (the fill value) to the chunk shape.
    Compressed inner chunks are encoded side by side on the codec pool (:func:`~.chunk_codec.codec_map`).
    """
    if tuple(data.shape) != plan.shard:
        padded = torch.zeros(plan.shard, dtype=data.dtype)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    if plan.compress != NONE:
        return _encode_compressed(plan, data)
    if plan.inner is None:
        raw = tensor_bytes(data.reshape(-1))  # reshape: tensor_bytes cannot view a 0-d tensor as bytes
        return [raw, crc32c(raw)]
    grid = tuple(s // i for s, i in zip(plan.shard, plan.inner))
    n = math.prod(grid)
    chunk = math.prod(plan.inner) * dtypes.itemsize(plan.dtype) + CRC_BYTES
    head = n * INDEX_ENTRY_BYTES + CRC_BYTES
    index = np.empty((n, 2), dtype="<u8")
    index[:, 0] = head + np.arange(n, dtype=np.uint64) * chunk
    index[:, 1] = chunk
    index_raw = index.tobytes()
    parts: list[bytes | memoryview] = [index_raw, crc32c(index_raw)]
    for coords in np.ndindex(*grid):  # C order, as the index lists them
        raw = tensor_bytes(data[tuple(slice(c * i, (c + 1) * i) for c, i in zip(coords, plan.inner))])
        parts += [raw, crc32c(raw)]
    return parts


def _inner_chunks(plan: ArrayPlan, data: torch.Tensor) -> list[torch.Tensor]:
    """The inner chunks of a (padded) cell, in the C order the shard index lists them."""
    if plan.inner is None:  # only sharded cells have inner chunks; python -O would strip an assert
        raise DataFileError(f"{plan.tensor}: an unsharded cell has no inner chunks to compress")
    grid = tuple(s // i for s, i in zip(plan.shard, plan.inner))
    return [data[tuple(slice(c * i, (c + 1) * i) for c, i in zip(coords, plan.inner))] for coords in np.ndindex(*grid)]


def _encode_compressed(plan: ArrayPlan, data: torch.Tensor) -> list[bytes | memoryview]:
    item = dtypes.itemsize(plan.dtype)
    if plan.inner is None:
        return list(compress_chunk(tensor_bytes(data.reshape(-1)), item))
    chunks = list(codec_map(lambda c: compress_chunk(tensor_bytes(c), item), _inner_chunks(plan, data)))
    n = len(chunks)
    sizes = np.array([len(frame) + CRC_BYTES for frame, _ in chunks], dtype=np.uint64)
    index = np.empty((n, 2), dtype="<u8")
    index[:, 1] = sizes
    index[:, 0] = n * INDEX_ENTRY_BYTES + CRC_BYTES + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
    index_raw = index.tobytes()
    parts: list[bytes | memoryview] = [index_raw, crc32c(index_raw)]
    for frame, crc in chunks:
        parts += [frame, crc]
    return parts


def missing_object(storage: Storage, relpath: str, what: str) -> DataFileError:
    """The error for an object the index lists that is not there."""
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
    if ref.compress != NONE:
        return _read_compressed(storage, ref, shape, r0, r1)
    where = storage.path(ref.file)
    torch_dtype = dtypes.to_torch(ref.dtype)
    item = dtypes.itemsize(ref.dtype)
    if ref.chunks is None:
        nbytes = math.prod(shape) * item
        try:
            (buf,) = storage.read_ranges([(ref.file, None, None)])
        except FileNotFoundError:
            raise missing_object(storage, ref.file, f"chunk of tensor {ref.tensor!r}") from None
        if len(buf) != nbytes + CRC_BYTES:
            raise DataFileError(
                f"{where}: chunk of tensor {ref.tensor!r} has {len(buf)} bytes, expected {nbytes + CRC_BYTES}: "
                "the object is truncated or replaced"
            )
        check_crc(buf, 0, nbytes, ref, where, "chunk")
        full = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        full = full.view(torch_dtype).reshape(shape)
        return full[r0:r1] if shape and (r0, r1) != (0, shape[0]) else full
    inner = ref.chunks
    grid = tuple(s // i for s, i in zip(shape, inner))
    n, per_band = math.prod(grid), math.prod(grid[1:])
    data_bytes = math.prod(inner) * item
    chunk = data_bytes + CRC_BYTES
    head = n * INDEX_ENTRY_BYTES + CRC_BYTES
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
        raise missing_object(storage, ref.file, f"shard of tensor {ref.tensor!r}") from None
    if len(index_raw) != head or len(data) != base + (k1 - k0) * chunk:
        raise DataFileError(f"{where}: shard of tensor {ref.tensor!r} ends early: the object is truncated")
    check_crc(index_raw, 0, head - CRC_BYTES, ref, where, "shard index")
    index = np.frombuffer(bytes(index_raw[: head - CRC_BYTES]), dtype="<u8").reshape(n, 2)
    want = head + np.arange(k0, k1, dtype=np.uint64) * chunk
    if not (np.array_equal(index[k0:k1, 0], want) and bool((index[k0:k1, 1] == chunk).all())):
        raise DataFileError(f"{where}: shard index of tensor {ref.tensor!r} is not in the layout moeckpt writes")
    out = torch.empty((out_rows,) + shape[1:], dtype=torch_dtype)
    place = _Placer(out, inner, grid, b0, item)

    def verify_and_place(j: int) -> None:
        off = base + j * chunk
        check_crc(data, off, data_bytes, ref, where, f"inner chunk {k0 + j}")
        place(k0 + j, np.frombuffer(data, dtype=np.uint8, count=data_bytes, offset=off))

    for _ in codec_map(verify_and_place, range(k1 - k0)):
        pass
    lo = r0 - b0 * inner[0]
    return out[lo : lo + (r1 - r0)] if (lo, r1 - r0) != (0, out_rows) else out


class _Placer:
    """Copies decoded inner chunks into their place in a band of rows of a cell, off the interpreter lock (numpy
    releases it for a plain copy; torch's own copies would each start an intra-op thread team, and many callers'
    teams oversubscribe the cores)."""

    def __init__(self, out: torch.Tensor, inner: tuple[int, ...], grid: tuple[int, ...], b0: int, item: int):
        # the band's bytes as uint8, its last dim widened by the element size (views of any dtype, bf16 included)
        self.bytes = out.view(torch.uint8).numpy()
        self.inner, self.grid, self.b0, self.item = inner, grid, b0, item
        self.shape = inner[:-1] + (inner[-1] * item,)

    def __call__(self, k: int, raw: np.ndarray) -> None:
        coords = np.unravel_index(k, self.grid)
        inner = self.inner
        dst = [slice((int(coords[0]) - self.b0) * inner[0], (int(coords[0]) - self.b0 + 1) * inner[0])]
        dst += [slice(int(c) * i, (int(c) + 1) * i) for c, i in zip(coords[1:], inner[1:])]
        last = dst[-1]
        dst[-1] = slice(last.start * self.item, last.stop * self.item)
        self.bytes[tuple(dst)] = raw.reshape(self.shape)


def decode_chunk(
    buf: bytes | bytearray | memoryview,
    off: int,
    end: int,
    nbytes: int,
    ref: PieceRef,
    where: str,
    what: str,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The ``nbytes`` decoded bytes of the compressed chunk ``buf[off:end]`` (then their crc32c), both checksums
    verified: the stored bytes' before decoding, the decoded bytes' after. ``out``: a byte array of exactly
    ``nbytes + 4`` to decode into (a reused buffer), else a new one."""
    mv = memoryview(buf)[off:end]
    if len(mv) < BLOSC_HEADER_BYTES + CRC_BYTES:
        raise DataFileError(f"{where}: {what} of tensor {ref.tensor!r} has {len(mv)} bytes: the object is truncated")
    check_crc(mv, 0, len(mv) - CRC_BYTES, ref, where, what)
    frame = mv[: len(mv) - CRC_BYTES]
    decoded, _, framed = struct.unpack_from("<III", frame, 4)
    if decoded != nbytes + CRC_BYTES or framed != len(frame):
        raise DataFileError(
            f"{where}: {what} of tensor {ref.tensor!r} is a blosc frame of {framed} bytes decoding to {decoded}, "
            f"expected {len(frame)} bytes decoding to {nbytes + CRC_BYTES}: the object is not what moeckpt writes"
        )
    if out is None or len(out) != decoded:
        out = np.empty(decoded, dtype=np.uint8)
    try:
        blosc_decompress_into(frame, out)
    except (RuntimeError, ValueError) as e:
        raise DataFileError(
            f"{where}: {what} of tensor {ref.tensor!r} cannot be decoded ({e}); it is corrupt"
        ) from None
    check_crc(out.data, 0, nbytes, ref, where, f"decoded {what}")
    return out


def _read_compressed(storage: Storage, ref: PieceRef, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows ``[r0, r1)`` of a compressed object (one chunk, or a shard): the whole inner chunks holding them are
    fetched and decoded."""
    where = storage.path(ref.file)
    torch_dtype = dtypes.to_torch(ref.dtype)
    item = dtypes.itemsize(ref.dtype)
    if ref.chunks is None:
        nbytes = math.prod(shape) * item
        try:
            (buf,) = storage.read_ranges([(ref.file, None, None)])
        except FileNotFoundError:
            raise missing_object(storage, ref.file, f"chunk of tensor {ref.tensor!r}") from None
        raw = decode_chunk(buf, 0, len(buf), nbytes, ref, where, "chunk")
        full = torch.from_numpy(raw[:nbytes]) if nbytes else torch.empty(0, dtype=torch.uint8)
        full = full.view(torch_dtype).reshape(shape)
        return full[r0:r1] if shape and (r0, r1) != (0, shape[0]) else full
    inner = ref.chunks
    grid = tuple(s // i for s, i in zip(shape, inner))
    n, per_band = math.prod(grid), math.prod(grid[1:])
    data_bytes = math.prod(inner) * item
    head = n * INDEX_ENTRY_BYTES + CRC_BYTES
    if r1 <= r0:
        return torch.empty((0,) + shape[1:], dtype=torch_dtype)
    b0, b1 = r0 // inner[0], -(-r1 // inner[0])
    k0, k1 = b0 * per_band, b1 * per_band
    whole = (k0, k1) == (0, n)
    try:
        # the whole shard: one request; some rows: the index, then the byte range of their chunks
        (data,) = storage.read_ranges([(ref.file, None, None) if whole else (ref.file, 0, head)])
    except FileNotFoundError:
        raise missing_object(storage, ref.file, f"shard of tensor {ref.tensor!r}") from None
    if len(data) < head:
        raise DataFileError(f"{where}: shard of tensor {ref.tensor!r} ends early: the object is truncated")
    check_crc(data, 0, head - CRC_BYTES, ref, where, "shard index")
    index = np.frombuffer(bytes(memoryview(data)[: head - CRC_BYTES]), dtype="<u8").reshape(n, 2).astype(np.int64)
    offsets, sizes = index[:, 0], index[:, 1]
    ends = head + np.cumsum(sizes)
    if (
        bool((index[:, 1] < BLOSC_HEADER_BYTES + 2 * CRC_BYTES).any())
        or offsets[0] != head
        or not np.array_equal(offsets[1:], ends[:-1])
        or (whole and len(data) != int(ends[-1]))
    ):
        raise DataFileError(
            f"{where}: shard index of tensor {ref.tensor!r} is not in the layout moeckpt writes (compressed inner "
            "chunks back to back, in order, to the object's end)"
        )
    lo, hi = int(offsets[k0]), int(ends[k1 - 1])
    if whole:
        base = 0
    else:
        try:
            (data,) = storage.read_ranges([(ref.file, lo, hi)])
        except FileNotFoundError:
            raise missing_object(storage, ref.file, f"shard of tensor {ref.tensor!r}") from None
        if len(data) != hi - lo:
            raise DataFileError(f"{where}: shard of tensor {ref.tensor!r} ends early: the object is truncated")
        base = lo
    out_rows = (b1 - b0) * inner[0]
    out = torch.empty((out_rows,) + shape[1:], dtype=torch_dtype)
    place = _Placer(out, inner, grid, b0, item)

    def decode_and_place(k: int) -> None:
        raw = decode_chunk(
            data, int(offsets[k]) - base, int(ends[k]) - base, data_bytes, ref, where, f"inner chunk {k}"
        )
        place(k, raw[:data_bytes])

    for _ in codec_map(decode_and_place, range(k0, k1)):
        pass
    lo_row = r0 - b0 * inner[0]
    return out[lo_row : lo_row + (r1 - r0)] if (lo_row, r1 - r0) != (0, out_rows) else out


def check_crc(
    buf: bytes | bytearray | memoryview,
    off: int,
    nbytes: int,
    ref: PieceRef,
    where: str,
    what: str,
    stored: bytes | None = None,
) -> None:
    """The crc32c of ``buf[off:off + nbytes]`` against the 4 bytes after them, or ``stored`` where given (a
    reader that read the checksum into a buffer of its own); a typed error naming the object and tensor."""
    mv = memoryview(buf)
    got = crc32c(mv[off : off + nbytes])
    if stored is None:
        stored = bytes(mv[off + nbytes : off + nbytes + CRC_BYTES])
    if got != stored:
        raise ChecksumMismatchError(
            f"{where}: checksum mismatch (crc32c) in {what} of tensor {ref.tensor!r} box {ref.box.to_json()} "
            f"(stored {stored.hex()}, computed {got.hex()}); the object is corrupt"
        )
