"""Loads into device memory through pinned staging: reads land in reused host buffers, then copy to the device.

Each fill thread of a device load owns a :class:`Stager`: two pinned buffers it reads into in turn and a copy
stream, so the read (and checksum) of one part overlaps the host-to-device copy of the one before. A part lands
in one of two ways:

* as it is stored, where its bytes are contiguous in the destination too (full-width rows of a stored piece, a
  contiguous byte range): one copy into the destination;
* *scattered*, where the destination takes a region of the rows read (the expert halves and ZeRO parts of a
  stored layout joined into fewer ranks, the TP halves of a matrix joined along its columns, a TP slice of rows
  narrower than a checksum block): the whole rows go to a device scratch buffer in one copy, and a device-side
  copy puts the region in place. No host-side assembly, no pageable copy.

On a machine without a device the copies are plain host copies; :func:`stages` is what decides, so the tests
run the staged paths on the CPU too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, cast

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.pieces import PieceRef, fetched_bytes

from .chunks import chunk_rows
from .plan import ReadItem, TargetPiece

ReadInto = Callable[[PieceRef, int, int, torch.Tensor], bool]


#: host tensors are loaded through staging too, as device tensors are: what the tests of the staged paths set on
#: machines without a device.
STAGE_HOST_MEMORY = False


def stages(dest: torch.Tensor) -> bool:
    """Whether reads into ``dest`` go through pinned staging (device memory), rather than straight in (host)."""
    return dest.device.type != "cpu" or STAGE_HOST_MEMORY


class Scatter(NamedTuple):
    """A scattered part: rows of ``shape`` are read, and each ``(dest, pick)`` of ``lands`` takes their region
    ``pick`` (slices of every dim but the first) into ``dest`` (a view of a destination, any strides)."""

    shape: tuple[int, ...]
    lands: tuple[tuple[torch.Tensor, tuple[slice, ...]], ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.lands[0][0].dtype

    @property
    def device(self) -> torch.device:
        return self.lands[0][0].device


class RowsGroup(NamedTuple):
    """Rows ``[r0, r1)`` of one stored piece, read whole, and the reads whose regions they hold, each with its
    position and destination (the whole target box): a box joined from several stored pieces takes one group per
    piece; the fused halves of a TP rank's slice (gate and up) take two regions of one group."""

    tensor: str
    src_box: Box
    rows: tuple[int, int]
    lands: tuple[tuple[int, ReadItem, torch.Tensor], ...]

    @property
    def positions(self) -> set[int]:
        return {pos for pos, _, _ in self.lands}


class Stager:
    """A thread's two reused staging buffers (pinned where the device has a host-to-device path), its copy stream
    and, for scattered parts, two device scratch buffers: :meth:`read` fills a destination with bytes read into
    a buffer, then copied from it asynchronously."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.nbytes = nbytes
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.scratch: list[torch.Tensor | None] = [None, None]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list = [None, None]
        self.turn = 0

    def read(self, fill: Callable[[torch.Tensor], bool], dest: torch.Tensor | Scatter) -> bool:
        """``fill(stage)`` reads bytes into the next staging buffer, viewed as ``dest`` (contiguous) or as the rows
        of a :class:`Scatter`; they are then copied to their place."""
        k = self.turn
        self.turn ^= 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copies out of this buffer have finished: it may be filled again
        if isinstance(dest, Scatter):
            scatter: Scatter | None = dest
            shape, dtype = dest.shape, dest.dtype
        else:
            scatter, shape, dtype = None, tuple(dest.shape), dest.dtype
        nbytes = _numel(shape) * dtype.itemsize
        stage = self.buffers[k][:nbytes].view(dtype).view(shape)
        if not fill(stage):
            return False
        if self.stream is None:
            if scatter is None:
                cast(torch.Tensor, dest).copy_(stage)
            else:
                for to, pick in scatter.lands:
                    to.copy_(stage[(slice(None),) + pick])
            return True
        with torch.cuda.stream(self.stream):
            if scatter is None:
                cast(torch.Tensor, dest).copy_(stage, non_blocking=True)
            else:
                rows = self._scratch(k)[:nbytes].view(dtype).view(shape)
                rows.copy_(stage, non_blocking=True)
                for to, pick in scatter.lands:
                    to.copy_(rows[(slice(None),) + pick])
            self.events[k] = torch.cuda.Event()
            self.events[k].record(self.stream)
        return True

    def _scratch(self, k: int) -> torch.Tensor:
        buf = self.scratch[k]
        if buf is None:
            buf = self.scratch[k] = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def staged_bytes(dest: torch.Tensor | Scatter) -> int:
    """The staging bytes a part of ``dest`` takes."""
    if isinstance(dest, Scatter):
        return _numel(dest.shape) * dest.dtype.itemsize
    return dest.numel() * dest.element_size()


#: a staged part: (fetched bytes, fill(stage) -> bool, the destination view or a Scatter).
Part = tuple[int, Callable[[torch.Tensor], bool], "torch.Tensor | Scatter"]


def scatter_groups(
    pieces: Sequence[TargetPiece],
    dests: Sequence[torch.Tensor],
    positions: Sequence[int],
    refs: Mapping[tuple[str, Box], PieceRef],
) -> list[RowsGroup]:
    """The reads of ``positions`` grouped by the stored rows they take, for the positions whose every read can be
    scattered: each read's stored piece has rows and checksum blocks, and reads of the same stored piece take
    the same rows or rows apart (rows that two groups would share are read once by the chunk cache instead)."""
    by_source: dict[tuple[str, Box], list[tuple[int, int, int, ReadItem]]] = {}
    ok = set()
    for pos in positions:
        piece = pieces[pos]
        if not piece.box.ndim or not piece.reads:
            continue
        refs_of = [refs.get((piece.tensor, r.src_box)) for r in piece.reads]
        if any(ref is None or not ref.block_bytes or not ref.box.ndim or not ref.box.shape[0] for ref in refs_of):
            continue
        ok.add(pos)
        for r in piece.reads:
            by_source.setdefault((piece.tensor, r.src_box), []).append((*r.rows, pos, r))
    clusters: list[list[tuple[int, int, int, ReadItem]]] = []
    for reads in by_source.values():
        reads.sort(key=lambda x: x[:3])
        end = -1
        for read in reads:  # clusters of overlapping rows of one stored piece
            if read[0] < end:
                clusters[-1].append(read)
                end = max(end, read[1])
            else:
                clusters.append([read])
                end = read[1]
    for cluster in clusters:
        if len({x[:2] for x in cluster}) > 1:
            ok -= {x[2] for x in cluster}
    groups = []
    for cluster in clusters:
        lands = tuple((pos, r, dests[pos]) for _, _, pos, r in cluster if pos in ok)
        if lands:
            r = lands[0][1]
            groups.append(RowsGroup(r.tensor, r.src_box, r.rows, lands))
    return [g for g in groups if g.positions <= ok]


def scatter_parts(ref: PieceRef, group: RowsGroup, stage_bytes: int, rows_into: ReadInto) -> list[Part]:
    """The staged parts of one group: its rows, on a grid of about ``stage_bytes`` aligned to the stored piece's
    checksum blocks, each read whole and its regions scattered into place (one copy where a single region is the
    rows' full width and lands contiguous)."""
    r0, r1 = group.rows
    per = max(1, chunk_rows(ref.box, ref.dtype, stage_bytes, ref.block_bytes))
    shape = tuple(group.src_box.shape[1:])
    where = []
    for _, item, dest in group.lands:
        in_dest = item.region.relative_to(item.target_box).slices()
        where.append((dest, in_dest[0].start, in_dest[1:], item.region.relative_to(item.src_box).slices()[1:]))
    whole = len(where) == 1 and group.lands[0][1].region.shape[1:] == group.src_box.shape[1:]
    parts: list[Part] = []
    lo = r0
    while lo < r1:
        hi = min(r1, (lo // per + 1) * per)
        # destination row ``first`` holds stored row r0
        lands = tuple(
            (dest[(slice(first + lo - r0, first + hi - r0),) + cols], pick) for dest, first, cols, pick in where
        )
        fill = functools.partial(rows_into, ref, lo, hi)
        at = lands[0][0]
        target = at if whole and at.is_contiguous() else Scatter((hi - lo,) + shape, lands)
        parts.append((fetched_bytes(ref, lo, hi), fill, target))
        lo = hi
    return parts
