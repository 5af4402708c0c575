"""A read session over zarr cells that lands rows straight in the caller's memory, verified as they land.

:func:`~.zarr_cells.read_piece` reads a cell's object into a fresh buffer, assembles the rows in a fresh tensor
and leaves the copy into the destination to its caller: three passes over new pages for every byte, where the
safetensors session makes one. :class:`ZarrReader` (``ZarrBackend.open_reader``) reads on local disk the way that
session does:

* a raw chunk, whole in the rows wanted, is read by one vectored read straight into the destination (its crc32c
  into scratch) and hashed there; the chunks the rows only partly cover are read into a reused scratch buffer,
  verified, and their rows copied over;
* compressed chunks are read into a reused buffer per thread, each decoded (on the codec pool) into a reused
  scratch buffer of its thread, both checksums verified, and the rows copied into place;
* a shard's index is read and checked once per object and session, not once per read.

A plain chunk (at most an inner chunk's bytes) of which only some rows are wanted, or stored padded, goes through a
reused scratch buffer. What it cannot read this way (a storage without direct reads, a cell stored padded along a
dimension other than the rows) it hands back: ``read_rows_into`` returns False and
the caller reads through :func:`~.zarr_cells.read_piece`. The bytes accepted are exactly those that function
accepts.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from .. import dtypes
from ..compression import NONE
from ..errors import DataFileError, StorageError
from ..pieces import PieceRef
from .base import PieceReaderBase
from .chunk_codec import BLOSC_MAX_OVERHEAD, codec_map
from .zarr_cells import (
    BLOSC_HEADER_BYTES,
    CRC_BYTES,
    INDEX_ENTRY_BYTES,
    check_crc,
    decode_chunk,
    missing_object,
)

if TYPE_CHECKING:
    from ..backend import Backend
    from ..storage import Storage


class _Shard:
    """A shard object's checked index: where each inner chunk's stored bytes begin and end."""

    __slots__ = ("starts", "ends")

    def __init__(self, starts: np.ndarray, ends: np.ndarray):
        self.starts, self.ends = starts, ends


class ZarrReader(PieceReaderBase):
    """Rows of zarr cells read into the caller's memory (``read_rows_into``), from several threads at once."""

    def __init__(self, backend: Backend, storage: Storage):
        super().__init__(backend, storage)
        self._files = storage.open_reader()
        self._local = threading.local()
        self._shards: dict[str, _Shard] = {}

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        if ref.box.ndim and hi > lo and self._can_read(ref):
            out = torch.empty((hi - lo,) + tuple(ref.box.shape[1:]), dtype=dtypes.to_torch(ref.dtype))
            if self.read_rows_into(ref, lo, hi, out):
                return out
        return super().read_rows(ref, lo, hi)

    def read_rows_into(self, ref: PieceRef, lo: int, hi: int, out: torch.Tensor) -> bool:
        """Rows ``[lo, hi)`` of the cell ``ref`` read into ``out`` (a contiguous CPU tensor of exactly those rows'
        bytes), every chunk they touch verified. False (nothing read) where this session cannot: see the module's
        docstring."""
        if not ref.box.ndim or hi <= lo or not self._can_read(ref):
            return False
        row = ref.nbytes // ref.box.shape[0] if ref.box.shape[0] else 0
        if out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() != (hi - lo) * row:
            return False
        dest = out.reshape(-1).view(torch.uint8).numpy()
        if ref.chunks is None:
            return self._read_plain(ref, lo, hi, dest)
        return self._read_sharded(ref, lo * row, hi * row, dest)

    def _can_read(self, ref: PieceRef) -> bool:
        stored = ref.stored_shape or tuple(ref.box.shape)
        # padding along the rows only: the destination's bytes are then a prefix of the stored rows' bytes
        return bool(self._files.direct and ref.nbytes and tuple(stored[1:]) == tuple(ref.box.shape[1:]))

    # -- one plain chunk ---------------------------------------------------------------------------------------

    def _read_plain(self, ref: PieceRef, lo: int, hi: int, dest: np.ndarray) -> bool:
        """A cell stored as one chunk (data and its crc32c, or compressed): whole and unpadded straight into
        ``dest``; else (some rows, a padded edge cell: one object of at most an inner chunk) through scratch."""
        stored = ref.stored_shape or tuple(ref.box.shape)
        where = self.storage.path(ref.file)
        item = dtypes.itemsize(ref.dtype)
        nbytes = math.prod(stored) * item
        row = math.prod(stored[1:]) * item
        if ref.compress != NONE:
            # no stat per object: read up to the largest frame this chunk can be, and one byte more
            bound = nbytes + CRC_BYTES + BLOSC_MAX_OVERHEAD + CRC_BYTES
            buf = self._buffer("packed", bound + 1)
            size = self._read_parts(ref, 0, [buf.data], "chunk")
            if size > bound:
                raise DataFileError(
                    f"{where}: chunk of tensor {ref.tensor!r} is longer than any blosc frame of its {nbytes} "
                    "bytes: the object is not what moeckpt writes"
                )
            scratch = self._buffer("decoded", nbytes + CRC_BYTES)
            decoded = decode_chunk(buf.data, 0, size, nbytes, ref, where, "chunk", scratch)
            _copy(dest, 0, decoded, lo * row, (hi - lo) * row)
            return True
        whole = (lo, hi) == (0, ref.box.shape[0]) and nbytes == ref.nbytes
        data = dest if whole else self._buffer("edge0", nbytes)
        tail = self._buffer("tail", CRC_BYTES + 1)  # the crc32c, and one byte more to see an object too long
        got = self._read_parts(ref, 0, [data.data, tail.data], "chunk")
        if got != nbytes + CRC_BYTES:
            raise DataFileError(
                f"{where}: chunk of tensor {ref.tensor!r} has {got}{'+' if got > nbytes + CRC_BYTES else ''} "
                f"bytes, expected {nbytes + CRC_BYTES}: the object is truncated or replaced"
            )
        _check_split(data, tail, ref, where, "chunk")
        if not whole:
            _copy(dest, 0, data, lo * row, (hi - lo) * row)
        return True

    # -- a shard of inner chunks -------------------------------------------------------------------------------

    def _read_sharded(self, ref: PieceRef, a: int, b: int, dest: np.ndarray) -> bool:
        """Bytes ``[a, b)`` of a shard's data (C order: inner chunks tile the stored cell's bytes in order)."""
        inner = ref.chunks
        item = dtypes.itemsize(ref.dtype)
        stored = ref.stored_shape or tuple(ref.box.shape)
        if inner is None or not _tiles_in_order(stored, inner):
            return False
        n = math.prod(s // i for s, i in zip(stored, inner))
        data_bytes = math.prod(inner) * item
        if not data_bytes:
            return False
        k0, k1 = a // data_bytes, -(-b // data_bytes)
        shard = self._shard(ref, n, data_bytes)
        where = self.storage.path(ref.file)
        if ref.compress != NONE:
            self._read_compressed(ref, shard, k0, k1, a, b, data_bytes, dest, where)
        else:
            self._read_raw(ref, shard, n, k0, k1, a, b, data_bytes, dest, where)
        return True

    def _read_raw(
        self, ref: PieceRef, shard: _Shard, n: int, k0: int, k1: int, a: int, b: int, data_bytes: int,
        dest: np.ndarray, where: str,
    ) -> None:  # fmt: skip
        crcs = self._buffer("crcs", (k1 - k0) * CRC_BYTES + 1)
        edges: list[tuple[int, np.ndarray]] = []  # chunks the bytes cover in part: read into scratch
        parts: list[memoryview] = []
        for k in range(k0, k1):
            start = k * data_bytes
            if a <= start and start + data_bytes <= b:
                parts.append(dest[start - a : start + data_bytes - a].data)
            else:
                scratch = self._buffer(f"edge{len(edges)}", data_bytes)
                edges.append((k, scratch))
                parts.append(scratch.data)
            parts.append(crcs[(k - k0) * CRC_BYTES : (k - k0 + 1) * CRC_BYTES].data)
        last = k1 == n
        if last:
            parts.append(crcs[-1:].data)  # one byte past the shard's end: an object too long is not ours
        want = (k1 - k0) * (data_bytes + CRC_BYTES)
        got = self._read_parts(ref, int(shard.starts[k0]), parts, "shard")
        if got != want:
            raise DataFileError(
                f"{where}: shard of tensor {ref.tensor!r} has {'more' if got > want else 'fewer'} bytes than its "
                "index says: the object is truncated or replaced"
            )
        scratch_of = dict(edges)
        for k in range(k0, k1):
            start = k * data_bytes
            crc = crcs[(k - k0) * CRC_BYTES : (k - k0 + 1) * CRC_BYTES]
            if k in scratch_of:
                chunk = scratch_of[k]
                _check_split(chunk, crc, ref, where, f"inner chunk {k}")
                lo, hi = max(a, start), min(b, start + data_bytes)
                _copy(dest, lo - a, chunk, lo - start, hi - lo)
            else:
                _check_split(dest[start - a : start + data_bytes - a], crc, ref, where, f"inner chunk {k}")

    def _read_compressed(
        self, ref: PieceRef, shard: _Shard, k0: int, k1: int, a: int, b: int, data_bytes: int, dest: np.ndarray,
        where: str,
    ) -> None:  # fmt: skip
        lo, hi = int(shard.starts[k0]), int(shard.ends[k1 - 1])
        last = k1 == len(shard.starts)
        packed = self._buffer("packed", hi - lo + last)  # one byte past the shard's end: an object too long
        got = self._read_parts(ref, lo, [packed.data], "shard")
        if got != hi - lo:
            raise DataFileError(
                f"{where}: shard of tensor {ref.tensor!r} has {'more' if got > hi - lo else 'fewer'} bytes than its "
                "index says: the object is truncated or replaced"
            )

        def decode(k: int) -> None:
            start = k * data_bytes
            decoded = decode_chunk(
                packed.data, int(shard.starts[k]) - lo, int(shard.ends[k]) - lo, data_bytes, ref, where,
                f"inner chunk {k}", self._buffer("decoded", data_bytes + CRC_BYTES),
            )  # fmt: skip
            c0, c1 = max(a, start), min(b, start + data_bytes)
            _copy(dest, c0 - a, decoded, c0 - start, c1 - c0)

        for _ in codec_map(decode, range(k0, k1)):
            pass

    def _shard(self, ref: PieceRef, n: int, data_bytes: int) -> _Shard:
        """The shard's index, read and checked the first time this session meets the object."""
        shard = self._shards.get(ref.file)
        if shard is not None:
            return shard
        where = self.storage.path(ref.file)
        head = n * INDEX_ENTRY_BYTES + CRC_BYTES
        raw = np.empty(head, dtype=np.uint8)
        self._read(ref, 0, [raw.data], head, "shard index")
        check_crc(raw.data, 0, head - CRC_BYTES, ref, where, "shard index")
        index = raw[: head - CRC_BYTES].view("<u8").reshape(n, 2).astype(np.int64)
        starts, sizes = index[:, 0], index[:, 1]
        ends = starts + sizes
        in_order = starts[0] == head and bool((starts[1:] == ends[:-1]).all())
        if ref.compress == NONE:
            ok = in_order and bool((sizes == data_bytes + CRC_BYTES).all())
        else:
            ok = in_order and not bool((sizes < BLOSC_HEADER_BYTES + 2 * CRC_BYTES).any())
        if not ok:
            raise DataFileError(f"{where}: shard index of tensor {ref.tensor!r} is not in the layout moeckpt writes")
        shard = self._shards[ref.file] = _Shard(starts, ends)
        return shard

    # -- reads and buffers -------------------------------------------------------------------------------------

    def _read(self, ref: PieceRef, offset: int, parts: list[memoryview], want: int, what: str) -> None:
        got = self._read_parts(ref, offset, parts, what)
        if got != want:
            raise DataFileError(
                f"{self.storage.path(ref.file)}: {what} of tensor {ref.tensor!r} ends early: the object is truncated"
            )

    def _read_parts(self, ref: PieceRef, offset: int, parts: list[memoryview], what: str) -> int:
        try:
            return self._files.read_into_parts(ref.file, offset, parts)
        except FileNotFoundError:
            raise missing_object(self.storage, ref.file, f"{what} of tensor {ref.tensor!r}") from None
        except StorageError as e:
            raise StorageError(f"{self.storage.path(ref.file)}: reading tensor {ref.tensor!r} failed: {e}") from e

    def _buffer(self, name: str, nbytes: int) -> np.ndarray:
        """This thread's reused buffer ``name`` of at least ``nbytes`` (a fresh one per read would fault in every
        page of it, every read), its first ``nbytes`` bytes."""
        held = self._local.__dict__.get(name)
        if held is None or len(held) < nbytes:
            held = np.empty(max(nbytes, 1), dtype=np.uint8)
            self._local.__dict__[name] = held
        return held[:nbytes]

    def close(self) -> None:
        self._files.close()


def _tiles_in_order(stored: tuple[int, ...], inner: tuple[int, ...]) -> bool:
    """Whether the inner chunks, in C order, are consecutive ranges of the cell's C-order bytes: every dimension
    before the last one split has chunks of 1, every one after it is whole (how moeckpt chooses inner chunks)."""
    split = [d for d, (s, i) in enumerate(zip(stored, inner)) if i < s]
    return not split or all(inner[d] == 1 for d in range(split[-1]))


def _copy(dest: np.ndarray, at: int, src: np.ndarray, start: int, nbytes: int) -> None:
    """``nbytes`` of ``src`` from ``start`` into ``dest`` at ``at``, off the interpreter lock (a foreign call)."""
    if nbytes > 0:
        ctypes.memmove(dest.ctypes.data + at, src.ctypes.data + start, nbytes)


def _check_split(data: np.ndarray, crc: np.ndarray, ref: PieceRef, where: str, what: str) -> None:
    """The crc32c of ``data`` against the 4 bytes ``crc`` stored after it (read into another buffer)."""
    check_crc(data.data, 0, len(data), ref, where, what, stored=crc[:CRC_BYTES].tobytes())
