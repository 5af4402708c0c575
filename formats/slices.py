"""Checksum blocks that follow the TP split (format version 5): a piece cut into column slices along its tensor's
TP dimension, each slice checksummed on its own, so a TP rank verifies its columns without reading the others.

A tensor whose layout rule splits a dimension ``d >= 1`` over TP ranks (``tp: {"dim": d}``, with or without
``blocks``) gives every TP rank a column range of each row. Checksum blocks that run along the piece's flat
bytes (version 1) mix every rank's columns, so verifying one rank's half means reading the whole row. Here the
writer cuts each TP block into :data:`TP_SLICES` equal parts (fewer where a block does not divide), cuts each
piece at those points, and checksums every slice as its own stream: outer rows (the dimensions before ``d``) in
groups of ``group_rows``, one checksum per (slice, group). A reader of some slices reads exactly their bytes of
each row; a reader of whole rows verifies every slice of the groups it reads. The data stay row-major: only the
checksums and a header member per piece (``<piece key>#slices``) change. docs/format.md is the specification.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import xxhash

from . import dtypes
from .box import Box
from .checksum import ALGORITHM
from .errors import ChecksumMismatchError

#: each TP block is cut into this many column slices (or the largest power of two below it that divides every
#: block): TP degrees 2, 4 and 8 read exactly their columns.
TP_SLICES = 8
#: the member of a safetensors header's ``__metadata__`` that records a piece's slices: ``<piece key>#slices``.
SLICES_SUFFIX = "#slices"
#: the member that records the block size of a piece cut along dimension 0: ``<piece key>#block``.
BLOCK_SUFFIX = "#block"
#: a piece cut along dimension 0 takes blocks aligned with the cuts only where they are at least this large
#: (narrower ones would make its checksum list long for little: such pieces are small).
MIN_ROW_BLOCK_BYTES = 4096
#: slices at least this wide in a row are hashed row by row straight from the buffer; narrower ones are gathered
#: into one contiguous copy first (a hash call per narrow row costs more than the copy).
_STREAM_SEGMENT_BYTES = 64 * 1024


def _rule_tp(sharding: dict) -> dict | None:
    tp = sharding.get("tp") if isinstance(sharding, dict) and "mesh" not in sharding else None
    if not isinstance(tp, dict) or "window" in tp or type(tp.get("dim")) is not int:
        return None
    return tp


def tensor_cuts(shape: tuple[int, ...], sharding: dict) -> tuple[int, tuple[int, ...]] | None:
    """``(d, cut points)``: where the slices of any piece of a tensor begin along its TP dimension ``d`` (every TP
    block cut into equal parts), or None for a tensor that is not sliced (no TP split along a dimension >= 1, a
    ``window`` split, a 0-dimensional tensor)."""
    tp = _rule_tp(sharding)
    if tp is None or not 0 <= tp["dim"] < len(shape):
        return None
    d = tp["dim"]
    blocks = tp.get("blocks") or [shape[d]]
    k = next((k for k in (TP_SLICES, 4, 2) if k <= TP_SLICES and all(b % k == 0 for b in blocks)), 1)
    cuts: set[int] = set()
    start = 0
    for b in blocks:
        cuts.update(start + i * (b // k) for i in range(k))
        start += b
    return d, tuple(sorted(cuts))


def slice_widths(shape: tuple[int, ...], sharding: dict, box: Box) -> tuple[int, tuple[int, ...]] | None:
    """``(d, widths)``: the slices a writer cuts the piece ``box`` into along dimension ``d`` (their sizes, in
    order, adding up to the box's), or None where no cut point lies strictly inside the box (the piece keeps the
    blocks of version 1)."""
    found = tensor_cuts(shape, sharding)
    if found is None or box.is_empty() or found[0] == 0:
        return None
    d, cuts = found
    lo, hi = box.offsets[d], box.offsets[d] + box.shape[d]
    inner = [c for c in cuts if lo < c < hi]
    if not inner:
        return None
    edges = [lo, *inner, hi]
    return d, tuple(b - a for a, b in zip(edges, edges[1:]))


def row_block(shape: tuple[int, ...], sharding: dict, itemsize: int, block: int) -> int | None:
    """The checksum block size of a tensor cut along dimension 0 (``tp.dim`` 0): ``G0`` whole rows, ``G0`` the
    largest divisor of ``g`` (the gcd of the cut points) whose rows fit in ``block``, so blocks end at the cuts;
    None where that is ``block`` itself, does not exist, or is below :data:`MIN_ROW_BLOCK_BYTES`."""
    found = tensor_cuts(shape, sharding)
    if found is None or found[0] != 0:
        return None
    row = itemsize
    for s in shape[1:]:
        row *= s
    g = 0
    for c in found[1]:
        g = math.gcd(g, c)
    if not g or not row:
        return None
    rows = max((k for k in _divisors(g) if k * row <= block), default=0)
    got = rows * row
    return got if MIN_ROW_BLOCK_BYTES <= got < block else None


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in small]


def piece_row_block(shape: tuple[int, ...], sharding: dict, box: Box, itemsize: int, block: int) -> int | None:
    """:func:`row_block` for the piece ``box`` where a cut point lies strictly inside its rows, else None."""
    b = row_block(shape, sharding, itemsize, block)
    if b is None or box.is_empty():
        return None
    found = tensor_cuts(shape, sharding)
    lo, hi = box.offsets[0], box.offsets[0] + box.shape[0]
    return b if found is not None and any(lo < c < hi for c in found[1]) else None


def tensor_sliced(shape: tuple[int, ...], sharding: dict, tp: int, itemsize: int = 1, block: int = 0) -> bool:
    """Whether a piece of this tensor, stored in a layout of ``tp`` TP ranks, may be sliced or take a row block
    (what makes an index version 5): its TP intervals hold a cut point strictly inside (and, cut along dimension
    0, its :func:`row_block` is one)."""
    found = tensor_cuts(shape, sharding)
    if found is None or not all(shape):
        return False
    d, cuts = found
    if d == 0 and row_block(shape, sharding, itemsize, block) is None:
        return False
    rule = _rule_tp(sharding) or {}
    n = shape[d]
    intervals = [(0, n)]
    if tp > 1:
        intervals, start = [], 0
        for b in rule.get("blocks") or [n]:
            part = b // tp
            intervals += [(start + r * part, start + (r + 1) * part) for r in range(tp)]
            start += b
    return any(lo < c < hi for lo, hi in intervals for c in cuts)


@dataclass(frozen=True)
class SliceGeometry:
    """A sliced piece seen as ``rows`` outer rows of ``row_bytes`` bytes; slice ``j`` is bytes ``[cols[j],
    cols[j+1])`` of every row; checksum ``j * groups + k`` covers rows ``[k*group_rows, (k+1)*group_rows)`` of
    slice ``j`` (the last group may be short)."""

    rows: int
    row_bytes: int
    cols: tuple[int, ...]
    group_rows: int

    @property
    def groups(self) -> int:
        return -(-self.rows // self.group_rows)

    @property
    def count(self) -> int:
        """How many checksums the piece has."""
        return (len(self.cols) - 1) * self.groups

    @property
    def unit_bytes(self) -> int:
        """Bytes of one group of whole rows: the unit a reader of whole rows widens its reads to."""
        return self.group_rows * self.row_bytes


def geometry(shape: tuple[int, ...], itemsize: int, dim: int, widths: tuple[int, ...], block: int) -> SliceGeometry:
    """The geometry of a piece of ``shape`` sliced along ``dim`` into ``widths``, with checksum block size
    ``block``: groups of ``max(1, block // row_bytes)`` rows, so a group of whole rows is about one block."""
    rows = 1
    for s in shape[:dim]:
        rows *= s
    inner = itemsize
    for s in shape[dim + 1 :]:
        inner *= s
    cols = [0]
    for w in widths:
        cols.append(cols[-1] + w * inner)
    return SliceGeometry(rows, cols[-1], tuple(cols), max(1, block // max(1, cols[-1])))


def _digest(h) -> str:
    return f"{ALGORITHM}:{h.hexdigest()}"


_gather = threading.local()


def _gathered(seg: np.ndarray) -> np.ndarray:
    """A strided 2-D uint8 ``seg`` copied into this thread's reused buffer (contiguous; valid until the thread's
    next call). A slice of a row group is a block's share, small enough to stay in the core's cache for the hash
    that follows; a fresh array per slice had its pages faulted in (and zeroed) anew each time, which made
    verifying narrow slices cost twice their hash."""
    n = seg.size
    buf = getattr(_gather, "buf", None)
    if buf is None or buf.size < n:
        buf = _gather.buf = np.empty(n, dtype=np.uint8)
    out = buf[:n].reshape(seg.shape)
    np.copyto(out, seg)
    return out


def _slice_digest(rows: np.ndarray, c0: int, c1: int) -> str:
    """The checksum of bytes ``[c0, c1)`` of every row of ``rows`` (a 2-D uint8 array), in row order."""
    seg = rows[:, c0:c1]
    if seg.flags.c_contiguous:
        return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(seg.data)}"
    if c1 - c0 >= _STREAM_SEGMENT_BYTES:
        h = xxhash.xxh3_64()
        for row in seg:
            h.update(row.data)
        return _digest(h)
    return f"{ALGORITHM}:{xxhash.xxh3_64_hexdigest(_gathered(seg).data)}"


def slice_checksums(data, geom: SliceGeometry) -> list[str]:
    """Every checksum of a sliced piece whose row-major bytes are ``data``, in the recorded order."""
    a = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8).reshape(geom.rows, geom.row_bytes)
    q = geom.group_rows
    return [
        _slice_digest(a[k * q : (k + 1) * q], geom.cols[j], geom.cols[j + 1])
        for j in range(len(geom.cols) - 1)
        for k in range(geom.groups)
    ]


def verify_columns(
    rows: np.ndarray,
    first_group: int,
    first_slice: int,
    geom: SliceGeometry,
    checksums: tuple[str, ...],
    where: str,
    what: str,
) -> None:
    """Check the slices held by ``rows`` (a 2-D uint8 array: whole groups of rows from group ``first_group``,
    columns from slice ``first_slice``'s start to a slice end) against their checksums."""
    q, base = geom.group_rows, geom.cols[first_slice]
    width = rows.shape[1] if rows.ndim == 2 else 0
    j1 = first_slice
    while j1 < len(geom.cols) - 1 and geom.cols[j1 + 1] - base <= width:
        j1 += 1
    for i in range(-(-rows.shape[0] // q)):
        k = first_group + i
        part = rows[i * q : (i + 1) * q]
        for j in range(first_slice, j1):
            at = j * geom.groups + k
            got = _slice_digest(part, geom.cols[j] - base, geom.cols[j + 1] - base)
            if k >= geom.groups or got != checksums[at]:
                want = checksums[at] if k < geom.groups else "none"
                raise ChecksumMismatchError(
                    f"{where}: checksum mismatch in tensor {what} slice {j} rows group {k} (expected {want}, got {got}); "
                    "the file is corrupt"
                )


def verify_rows(data, first_group: int, geom: SliceGeometry, checksums: tuple[str, ...], where: str, what: str) -> None:
    """Check whole rows ``data`` (groups from ``first_group``, all slices) against their checksums."""
    mv = memoryview(data).cast("B")
    n = len(mv) // geom.row_bytes if geom.row_bytes else 0
    if n * geom.row_bytes != len(mv):
        raise ChecksumMismatchError(f"{where}: a read of {len(mv)} bytes is not whole rows of sliced tensor {what}")
    a = np.frombuffer(mv, dtype=np.uint8).reshape(n, geom.row_bytes)
    verify_columns(a, first_group, 0, geom, checksums, where, what)


class SliceHasher:
    """The checksums of a sliced piece whose row-major bytes arrive in arbitrary slices (a piece streamed slab by
    slab): each slice's stream is hashed group by group, whole rows gathered a fragment at a time."""

    def __init__(self, geom: SliceGeometry):
        self._g = geom
        self._n = len(geom.cols) - 1
        self._h = [xxhash.xxh3_64() for _ in range(self._n)]
        self._col = 0  # bytes of the current row already fed
        self._row = 0  # rows of the current group already fed
        self._sums: list[list[str]] = [[] for _ in range(self._n)]

    def update(self, data) -> None:
        g = self._g
        mv = memoryview(data).cast("B")
        while len(mv):
            if self._col == 0 and len(mv) >= g.row_bytes:
                n = min(len(mv) // g.row_bytes, g.group_rows - self._row)
                whole = np.frombuffer(mv[: n * g.row_bytes], dtype=np.uint8).reshape(n, g.row_bytes)
                for j in range(self._n):
                    seg = whole[:, g.cols[j] : g.cols[j + 1]]
                    if seg.flags.c_contiguous:
                        self._h[j].update(seg.data)
                    elif g.cols[j + 1] - g.cols[j] >= _STREAM_SEGMENT_BYTES:
                        for row in seg:
                            self._h[j].update(row.data)
                    else:
                        self._h[j].update(_gathered(seg).data)
                mv = mv[n * g.row_bytes :]
                self._rows_done(n)
                continue
            take = min(len(mv), g.row_bytes - self._col)
            a, b = self._col, self._col + take
            for j in range(self._n):
                lo, hi = max(a, g.cols[j]), min(b, g.cols[j + 1])
                if hi > lo:
                    self._h[j].update(mv[lo - a : hi - a])
            self._col = b
            mv = mv[take:]
            if self._col == g.row_bytes:
                self._col = 0
                self._rows_done(1)

    def _rows_done(self, n: int) -> None:
        self._row += n
        if self._row == self._g.group_rows:
            self._close()

    def _close(self) -> None:
        for j in range(self._n):
            self._sums[j].append(_digest(self._h[j]))
            self._h[j] = xxhash.xxh3_64()
        self._row = 0

    def finish(self) -> list[str]:
        """The checksums in the recorded order (slice by slice, group by group)."""
        if self._row or self._col:
            self._close()
        return [s for sums in self._sums for s in sums]


def piece_geometry(shape: tuple[int, ...], sharding: dict, box: Box, dtype: str, block: int) -> SliceGeometry | None:
    """The geometry a writer gives the piece ``box`` of a tensor, or None where it keeps version 1's blocks."""
    found = slice_widths(shape, sharding, box)
    if found is None:
        return None
    d, widths = found
    return geometry(box.shape, dtypes.itemsize(dtype), d, widths, block)


def column_span(geom: SliceGeometry, s0: int, s1: int, c0: int, c1: int) -> tuple[int, int, int, int, int, int]:
    """Bytes ``[c0, c1)`` of rows ``[s0, s1)`` widened to what a verified read fetches: whole slices and whole
    row groups. Returns ``(first group, first slice, row lo, row hi, column lo, column hi)``."""
    cols = geom.cols
    j0 = max(j for j in range(len(cols) - 1) if cols[j] <= c0)
    j1 = min(j for j in range(1, len(cols)) if cols[j] >= c1)
    q = geom.group_rows
    g0 = s0 // q
    return g0, j0, g0 * q, min(-(-s1 // q) * q, geom.rows), cols[j0], cols[j1]


def columns_fetched(geom: SliceGeometry, s0: int, s1: int, c0: int, c1: int) -> int:
    """Bytes a verified read of bytes ``[c0, c1)`` of rows ``[s0, s1)`` fetches (:func:`column_span`)."""
    _, _, r0, r1, a, b = column_span(geom, s0, s1, c0, c1)
    return (r1 - r0) * (b - a)
