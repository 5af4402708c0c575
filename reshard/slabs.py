"""Slab assembly: target boxes filled from the reads of a plan, whole or in row slabs, or taken as read.

A target box is filled from its :class:`~moeckpt.reshard.plan.ReadItem` values through a
:class:`~moeckpt.reshard.chunks.ChunkReader`. Where a box is the full width of one stored piece, its rows are
the source chunks themselves (a *direct read*), and no copy is made.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError

from .chunks import ChunkReader, grid_spans
from .options import SLAB_BYTES
from .plan import ReadItem, TargetPiece


def fill(out: torch.Tensor, out_box: Box, reads: Sequence[ReadItem], chunks: ChunkReader) -> int:
    """Copy into ``out`` (holding ``out_box``) every part of ``reads`` that falls in it; returns elements copied."""
    copied = 0
    for item in reads:
        sub = item.region.intersect(out_box) if out_box.ndim else item.region
        if sub is None:
            continue
        rel = sub.relative_to(item.src_box)
        if out_box.ndim:
            at = out[sub.relative_to(out_box).slices()]
            chunks.copy_region(item.tensor, item.src_box, rel, at, until=item.rows[1])
        else:
            out.copy_(chunks.rows(item.tensor, item.src_box, 0, 1, until=1))
        copied += sub.numel
    return copied


def direct_read(piece: TargetPiece) -> ReadItem | None:
    """The single read that is the whole piece at the full width of its stored piece, if there is one."""
    if len(piece.reads) != 1 or not piece.box.ndim:
        return None
    r = piece.reads[0]
    src, box = r.src_box, piece.box
    if r.region != box or src.offsets[1:] != box.offsets[1:] or src.shape[1:] != box.shape[1:]:
        return None
    return r


def row_bytes_of(region: Box, box: Box, itemsize: int, depth: int = 1) -> tuple[int, int] | None:
    """Bytes ``[c0, c1)`` that ``region`` takes within each sub-row of ``box`` (which it lies in), a sub-row being
    the slice at one index of dims ``[0, depth)``, where they are one contiguous range (row-major: every dim after
    the first partial one whole, every one before it of size one); None where they are not."""
    n = box.ndim
    k = next((d for d in range(depth, n) if region.shape[d] != 1), n - 1)
    if any(region.shape[d] != box.shape[d] for d in range(k + 1, n)):
        return None
    stride, c0 = itemsize, 0
    for d in reversed(range(depth, n)):
        c0 += (region.offsets[d] - box.offsets[d]) * stride
        stride *= box.shape[d]
    inner = itemsize
    for d in range(depth, n):
        inner *= region.shape[d]
    return c0, c0 + inner


class RowSpan(NamedTuple):
    """Where a read's bytes lie in the rows of its stored piece and of the target box: bytes ``[c0, c1)`` of
    each source sub-row land at byte ``d0`` of the matching target sub-row; a row (dim 0) is ``sub`` sub-rows
    (the slices at one index of its first dims that both boxes hold whole)."""

    c0: int
    c1: int
    d0: int
    sub: int = 1


def row_spans(piece: TargetPiece, itemsize: int) -> list[tuple[ReadItem, RowSpan]] | None:
    """Where every read of ``piece`` is, within each (sub-)row of its stored piece and of the target box, one
    contiguous byte range (a TP rank's slice of each expert's matrix split along dim 1; the TP halves of a matrix
    loaded whole, split along its last dim or not; row ranges of several stored pieces): per read, its
    :class:`RowSpan` at the shallowest sub-row depth where there is one. None otherwise. Such a box is read
    straight into its place (:mod:`.inplace`), without assembly."""
    box = piece.box
    if not piece.reads or box.ndim < 1 or box.is_empty():
        return None
    out = []
    for r in piece.reads:
        src, region = r.src_box, r.region
        for depth in range(1, max(2, box.ndim)):
            if any(region.shape[d] != src.shape[d] or region.shape[d] != box.shape[d] for d in range(1, depth)):
                return None  # a deeper sub-row would not map source sub-rows onto target sub-rows one to one
            in_src = row_bytes_of(region, src, itemsize, depth)
            in_box = row_bytes_of(region, box, itemsize, depth)
            if in_src is not None and in_box is not None:
                sub = 1
                for d in range(1, depth):
                    sub *= box.shape[d]
                out.append((r, RowSpan(in_src[0], in_src[1], in_box[0], sub)))
                break
        else:
            return None
    return out


def slabs(
    piece: TargetPiece, dtype: str, chunks: ChunkReader, slab_bytes: int = SLAB_BYTES, *, reuse: bool = False
) -> Iterator[torch.Tensor]:
    """A target piece in row slabs of about ``slab_bytes``, each filled from its reads.

    When the piece is a full-width row range of one stored piece, the slabs are the source chunks themselves (no
    copy). With ``reuse``, other slabs share one per-thread buffer: the caller must consume each slab before
    asking for the next (a streaming writer does), which spares a fresh allocation and its page faults per slab.
    """
    box = piece.box
    torch_dtype = dtypes.to_torch(dtype)
    if not box.ndim or box.is_empty():
        out = torch.empty(box.shape, dtype=torch_dtype)
        if not box.is_empty():
            fill(out, box, piece.reads, chunks)
        yield out
        return
    direct = direct_read(piece)
    if direct is not None:
        src = direct.src_box
        per = chunks.chunk_rows(chunks.ref(direct.tensor, src))
        r0, r1 = direct.rows
        for lo, hi in grid_spans(r0, r1, per):  # inside one source chunk each: a view, not a concatenation
            yield chunks.rows(direct.tensor, src, lo, hi, until=r1)
        return
    row = box.numel // box.shape[0] * dtypes.itemsize(dtype)
    per = max(1, slab_bytes // max(1, row))
    for lo in range(0, box.shape[0], per):
        n = min(per, box.shape[0] - lo)
        sbox = Box((box.offsets[0] + lo,) + box.offsets[1:], (n,) + box.shape[1:])
        if reuse:
            out = thread_buffer(sbox.numel * dtypes.itemsize(dtype)).view(torch_dtype).reshape(sbox.shape)
        else:
            out = torch.empty(sbox.shape, dtype=torch_dtype)
        if fill(out, sbox, piece.reads, chunks) != sbox.numel:
            raise CheckpointIndexError(f"tensor {piece.tensor!r}: reads do not fill box {sbox.to_json()}")
        yield out


def whole_chunk(piece: TargetPiece, chunks: ChunkReader) -> torch.Tensor | None:
    """The read buffer itself when a box is exactly one whole read chunk of a stored piece (no copy), else None."""
    r = direct_read(piece)
    if r is None:
        return None
    r0, r1 = r.rows
    src = r.src_box
    per = chunks.chunk_rows(chunks.ref(r.tensor, src))
    if chunks.clip:
        if r0 // per != (r1 - 1) // per:
            return None  # several chunks: they are joined into a new tensor anyway
        return chunks.rows(r.tensor, src, r0, r1)  # a clipped chunk holds exactly these rows
    if r0 % per or (r1 != src.shape[0] and r1 - r0 != per) or r1 - r0 > per:
        return None  # a part of a chunk: a view would pin the rest of it in memory
    return chunks.rows(r.tensor, src, r0, r1)


def assemble(piece: TargetPiece, dtype: str, chunks: ChunkReader) -> torch.Tensor:
    """The whole target box of ``piece``: the read chunk itself where it is one (:func:`whole_chunk`), else a new
    tensor filled from its reads."""
    out = whole_chunk(piece, chunks)
    if out is None:
        out = torch.empty(piece.box.shape, dtype=dtypes.to_torch(dtype))
        fill(out, piece.box, piece.reads, chunks)
    return out


_local = threading.local()


def thread_buffer(nbytes: int) -> torch.Tensor:
    """A per-thread byte buffer of at least ``nbytes``, reused across slabs."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf[:nbytes]
