"""A piece's bytes on their way into a file: in row-major order without copying a strided tensor whole, hashed
block by block right before each part is written (while still in the CPU cache), small writes coalesced and the
disk writeback started along the way.

A save is bound by memory traffic and the disk, not by hashing, so the writers of :mod:`.safetensors_write` touch
the data as few times as possible through these helpers; :class:`BlockHasher` gives the block checksums of bytes
that arrive in arbitrary slices (a piece streamed slab by slab).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from ..checksum import checksum
from ..pieces import CHECKSUM_BLOCK_BYTES
from ..slices import SliceGeometry, SliceHasher
from ..writeback import Writeback

if TYPE_CHECKING:
    import torch

#: rows of a strided piece at least this long are written straight from the trainer's tensor; shorter ones are
#: gathered into a reused buffer first, so that small rows do not turn into many small writes.
_DIRECT_ROW_BYTES = 64 * 1024


def stream_piece(
    data: torch.Tensor,
    write: Callable[[memoryview], object] | None,
    geometry: SliceGeometry | None = None,
    block: int = CHECKSUM_BLOCK_BYTES,
) -> list[str]:
    """Hash a piece's bytes in blocks of ``block`` bytes (slice by slice where ``geometry`` is given), passing
    each part to ``write`` right after hashing it."""
    if data.device.type != "cpu":
        data = data.cpu()
    if geometry is None and data.is_contiguous() and data.numel() * data.element_size() <= block:
        # Most pieces (norms, biases, small projections) are one contiguous block: skip the machinery below.
        mv = _contiguous_bytes(data)
        if write is not None:
            write(mv)
        return [checksum(mv)]
    hasher: BlockHasher | SliceHasher = BlockHasher(block) if geometry is None else SliceHasher(geometry)
    for frag in _fragments(data):
        for i in range(0, len(frag), block):
            part = frag[i : i + block]
            hasher.update(part)
            if write is not None:
                write(part)
    return hasher.finish()


def flat_if_scalar(t: torch.Tensor) -> torch.Tensor:
    # A 0-dim tensor cannot be viewed as bytes of another element size; as one element it can, with the same bytes.
    return t.reshape(1) if t.dim() == 0 else t


def _fragments(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of ``t`` in row-major order as contiguous buffers, without copying a strided tensor whole.

    A yielded buffer may be reused for the next one: consume it before advancing.
    """
    import torch

    t = flat_if_scalar(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return
    if t.is_contiguous():
        yield _contiguous_bytes(t)
    elif t.stride(-1) == 1:
        # Rows of a view along a leading dim: walk them as numpy byte arrays, several times cheaper per row than
        # torch indexing (a fused gate/up block has a few hundred rows per piece).
        yield from _byte_rows(t.view(torch.uint8).numpy())
    else:
        yield from _gathered(t)


def _byte_rows(a: np.ndarray) -> Iterator[memoryview]:
    if a.flags.c_contiguous:
        yield a.data.cast("B")
        return
    if a[0].nbytes >= _DIRECT_ROW_BYTES:
        for row in a:
            yield from _byte_rows(row)
        return
    per = max(1, CHECKSUM_BLOCK_BYTES // a[0].nbytes)
    scratch = np.empty((min(per, a.shape[0]),) + a.shape[1:], dtype=np.uint8)
    for r0 in range(0, a.shape[0], per):
        n = min(per, a.shape[0] - r0)
        np.copyto(scratch[:n], a[r0 : r0 + n])
        yield scratch[:n].data.cast("B")


def _gathered(t: torch.Tensor) -> Iterator[memoryview]:
    """Any other layout (e.g. a transposed view): copied a block's worth of rows at a time into one buffer."""
    import torch

    row_bytes = max(1, t[0].numel() * t.element_size())
    per = max(1, CHECKSUM_BLOCK_BYTES // row_bytes)
    scratch = torch.empty((min(per, t.shape[0]),) + tuple(t.shape[1:]), dtype=t.dtype)
    for r0 in range(0, t.shape[0], per):
        n = min(per, t.shape[0] - r0)
        scratch[:n].copy_(t[r0 : r0 + n])
        yield _contiguous_bytes(scratch[:n])


def _contiguous_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (a leaner :func:`tensor_bytes` for the hot loop)."""
    import torch

    t = flat_if_scalar(t)
    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().view(torch.uint8).numpy().data.cast("B")


class Coalescer:
    """Gathers small writes into one buffer so that hundreds of norm-sized pieces cost a few system calls.

    Large parts bypass the buffer (after flushing it), so big tensors are written straight from their memory.
    """

    LIMIT = 1 << 20

    def __init__(self, write: Callable[[memoryview], object], kick: WritebackKick | None = None):
        self._write = write
        self._kick = kick
        self._buf = bytearray(self.LIMIT)
        self._used = 0

    def write(self, part: memoryview) -> None:
        n = len(part)
        if n >= self.LIMIT // 16:
            self.flush()
            self._write(part)
            if self._kick is not None:
                self._kick.wrote(n)
            return
        if self._used + n > self.LIMIT:
            self.flush()
        self._buf[self._used : self._used + n] = part
        self._used += n

    def flush(self) -> None:
        if self._used:
            self._write(memoryview(self._buf)[: self._used])
            if self._kick is not None:
                self._kick.wrote(self._used)
            self._used = 0


class WritebackKick:
    """Starts the disk writeback of what was written so far, every ``EVERY`` bytes, without waiting for it
    (:class:`~moeckpt.formats.writeback.Writeback`): the closing fsync then finds most of the file on disk."""

    EVERY = 32 << 20

    def __init__(self, f, start: int, writeback: Writeback):
        self._f = f
        self._done = start  # bytes already handed to the kernel for writeback (the header placeholder is not)
        self._pos = start
        self._writeback = writeback

    def wrote(self, n: int) -> None:
        self._pos += n
        if self._pos - self._done < self.EVERY:
            return
        self._f.flush()
        self._writeback.start(self._done, self._pos - self._done)
        self._done = self._pos


class BlockHasher:
    """Block checksums of a byte stream fed in arbitrary slices (a piece written slab by slab)."""

    def __init__(self, block_bytes: int = CHECKSUM_BLOCK_BYTES):
        import xxhash

        self._new = xxhash.xxh3_64
        self._block = block_bytes
        self._h = self._new()
        self._fill = 0
        self.sums: list[str] = []

    def update(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), self._block - self._fill)
            self._h.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == self._block:
                self.sums.append(f"xxh3_64:{self._h.hexdigest()}")
                self._h, self._fill = self._new(), 0

    def finish(self) -> list[str]:
        """The checksums, the last (short) block included; an empty stream has one checksum of no bytes."""
        if self._fill or not self.sums:
            self.sums.append(f"xxh3_64:{self._h.hexdigest()}")
            self._h, self._fill = self._new(), 0
        return self.sums
