"""Boxes read straight into their destination: in place on the CPU, through pinned staging into device memory.

A box that is full-width rows of one stored piece is contiguous in the file and in its tensor, so it needs no
assembly: threads (``LoadOptions.fill_threads``; ``pread`` and the checksums release the interpreter lock) read
it in parts of the chunk grid, each part verified as it lands (``read_rows_into`` of the backend's session).
Into device memory (a GPU), each thread reads a part into one of its two reused pinned buffers and copies it to
the device on a stream of its own while it reads the next part into the other (:mod:`.staging`), so reads,
checksums and host-to-device copies overlap and no pageable copy is made; a box joined from several stored
pieces, or a region of their rows, is read in whole rows and scattered into place on the device. Without a
device (CPU-only machines) the staging copies are plain copies, which is what the tests run.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.pieces import PieceRef, fetched_bytes
from moeckpt.formats.slices import column_span, columns_fetched

from . import device_checks, page_lock
from .chunks import ChunkReader, chunk_rows, grid_spans
from .device_checks import DeviceChecks
from .options import LOAD_MAPPED_BYTES, LOAD_STAGE_BYTES
from .page_lock import MappedRows
from .plan import ReadItem, TargetPiece
from .slabs import RowSpan, direct_read, row_spans, thread_buffer
from .staging import (
    ReadInto,
    Rows,
    RowsGroup,
    Run,
    RunInto,
    Scatter,
    Stager,
    coalesce,
    is_small,
    scatter_groups,
    scatter_parts,
    staged_bytes,
    stages,
    whole_piece_view,
)

SegmentsInto = Callable[[PieceRef, list[tuple[int, memoryview]]], bool]
ColumnsInto = Callable[[PieceRef, int, int, int, int, torch.Tensor], bool]


def _cannot_read(ref: PieceRef, lo: int, hi: int, out: torch.Tensor) -> bool:
    """The in-place read of a session that has none: reads nothing."""
    del ref, lo, hi, out
    return False


def _cannot_read_segments(ref: PieceRef, segments: list[tuple[int, memoryview]]) -> bool:
    """The vectored read of a session that has none: reads nothing."""
    del ref, segments
    return False


#: a job: (position, the read, its destination, and None for whole rows, where the read's bytes lie in each row
#: of its stored piece and of the destination, or the group of reads whose rows are staged whole and scattered
#: into place, the group's first read and destination in front).
Job = tuple[int, ReadItem, torch.Tensor, "RowSpan | RowsGroup | None"]


def positions(job: Job) -> set[int]:
    """The positions a job fills."""
    return job[3].positions if isinstance(job[3], RowsGroup) else {job[0]}


#: a span whose every range is at least this long is read by vectored reads straight into place; shorter ones
#: are read into a reused buffer and copied (strided) into place, as a range per row would cost more than a copy.
VECTORED_RANGE_BYTES = 64 * 1024
#: a part of a span read through a buffer covers about this many bytes of file (cut at checksum blocks).
COPY_PART_BYTES = 8 * 1024 * 1024


def in_place_jobs(
    pos: int, piece: TargetPiece, refs: Mapping[tuple[str, Box], PieceRef], dest: torch.Tensor
) -> list[Job]:
    """The jobs that read box ``piece`` (at ``pos``) straight into ``dest``: one if it is full-width rows of one
    stored piece, one per read where its reads are spans (:func:`spans_in_place`), none otherwise (the caller
    assembles it through the chunk cache)."""
    if (r := direct_read(piece)) is not None:
        return [(pos, r, dest, None)]
    spans = spans_in_place(piece, refs, dest)
    return [] if spans is None else [(pos, item, dest, span) for item, span in spans]


def scattered_jobs(
    pieces: Sequence[TargetPiece], dests: Sequence[torch.Tensor], positions: Sequence[int], refs
) -> list[Job]:
    """The jobs of the staged ``positions`` (boxes that :func:`in_place_jobs` cannot read straight into place)
    whose reads are whole rows scattered into place on the device (:func:`~.staging.scatter_groups`)."""
    return [(*g.lands[0], g) for g in scatter_groups(pieces, dests, positions, refs)]


def spans_in_place(
    piece: TargetPiece, refs: Mapping[tuple[str, Box], PieceRef], dest: torch.Tensor
) -> list[tuple[ReadItem, RowSpan]] | None:
    """:func:`~.slabs.row_spans` of ``piece`` where :func:`read_in_place` can read them into ``dest``, else None.

    Into CPU memory, long ranges are read straight into place and short ones through a buffer, unless the bytes
    between them hold a whole checksum block (the rows would be read for a small part of each: the chunk cache
    does that better). Into a device each range goes through a staging buffer on its own, so every source row
    must be two checksum blocks or more (the ranges of different rows share no block: none is fetched twice)."""
    if not dest.is_contiguous():
        return None
    refs_of = []
    for item in piece.reads:
        ref = refs.get((piece.tensor, item.src_box))
        if ref is None or not ref.block_bytes or not ref.box.ndim or not ref.box.shape[0]:
            return None
        refs_of.append(ref)
    if not refs_of:
        return None
    spans = row_spans(piece, dtypes.itemsize(refs_of[0].dtype))
    if spans is None:
        return None
    for ref, (_, span) in zip(refs_of, spans):
        row = ref.nbytes // ref.box.shape[0]
        if sliced_columns(ref, span):
            continue  # read by slices: exactly the rows' columns, into place or through staging
        if stages(dest):
            if span.sub != 1 or row < 2 * ref.block_bytes:
                return None
        elif span.c1 - span.c0 < VECTORED_RANGE_BYTES and row // span.sub - (span.c1 - span.c0) >= ref.block_bytes:
            return None
    return spans


def sliced_columns(ref: PieceRef, span: RowSpan) -> bool:
    """Whether a span of a sliced stored piece (format version 5) is read by its slices: the span's sub-rows are
    the piece's outer rows (the dimensions before its slice dimension), and the slices around the span's bytes
    leave some of each row out."""
    g = ref.geometry
    if g is None or not ref.box.shape[0] or ref.nbytes // ref.box.shape[0] != span.sub * g.row_bytes:
        return False
    *_, a, b = column_span(g, 0, 1, span.c0, span.c1)
    return b - a < g.row_bytes


def _column_parts(
    ref: PieceRef, item: ReadItem, dest: torch.Tensor, span: RowSpan, chunk_bytes: int, columns_into: ColumnsInto
) -> list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]]:
    """The parts of a span read by slices (:func:`sliced_columns`): the span's outer rows cut at row groups about
    every ``chunk_bytes`` of its columns, each part read straight into its rows of the destination (a strided
    view) or through staging."""
    g = _Strided.of(ref, item, dest, span)
    geom = ref.geometry
    if geom is None:  # sliced_columns chose this span: never
        return []
    width = g.c1 - g.c0
    q = geom.group_rows
    per = max(q, chunk_bytes // max(1, width) // q * q)
    flat = dest.reshape(-1).view(torch.uint8)
    out: list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]] = []
    lo = g.s0
    while lo < g.s1:
        hi = min(g.s1, (lo // per + 1) * per)
        target = flat.as_strided((hi - lo, width), (g.dest_sub, 1), flat.storage_offset() + g.dest_at(lo))
        fill = functools.partial(columns_into, ref, lo, hi, g.c0, g.c1)
        out.append((columns_fetched(geom, lo, hi, g.c0, g.c1), fill, target))
        lo = hi
    return out


class _Strided(NamedTuple):
    """Sub-row geometry of a span: bytes ``[c0, c1)`` of source sub-row ``s`` (of ``src_sub`` bytes; ``[s0, s1)``
    read) land at byte ``d0`` of target sub-row ``t0 + s - s0`` (of ``dest_sub``)."""

    src_sub: int
    c0: int
    c1: int
    dest_sub: int
    d0: int
    s0: int
    s1: int
    t0: int

    @classmethod
    def of(cls, ref: PieceRef, item: ReadItem, dest: torch.Tensor, span: RowSpan) -> _Strided:
        c0, c1, d0, sub = span
        r0, r1 = item.rows
        src_sub = ref.nbytes // ref.box.shape[0] // sub
        dest_sub = dest.numel() * dest.element_size() // (dest.shape[0] * sub)
        t0 = (item.region.offsets[0] - item.target_box.offsets[0]) * sub  # target sub-row of source sub-row s0
        return cls(src_sub, c0, c1, dest_sub, d0, r0 * sub, r1 * sub, t0)

    def dest_at(self, s: int) -> int:
        """Where the range of source sub-row ``s`` lands in the destination's bytes."""
        return (self.t0 + s - self.s0) * self.dest_sub + self.d0


def _blocks_around(ref: PieceRef, a: int, b: int) -> int:
    """Bytes of the whole checksum blocks around bytes ``[a, b)`` of ``ref`` (what a verified read of them fetches)."""
    block = ref.unit_bytes
    return min(-(-b // block) * block, ref.nbytes) - a // block * block


def _vectored_parts(
    ref: PieceRef,
    item: ReadItem,
    dest: torch.Tensor,
    span: RowSpan,
    chunk_bytes: int,
    bytes_into: ReadInto,
    segments_into: SegmentsInto,
) -> list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]]:
    """The parts of a span of long ranges, each ``(fetched bytes, fill(target) -> bool, target)``.

    The (sub-)rows' ranges (merged where they run on in the file and in ``dest``, cut at checksum blocks about every
    ``chunk_bytes``) are read in groups: ranges that share a checksum block or lie in neighbouring blocks go
    together, up to about ``chunk_bytes`` of file a group (never splitting a shared block), each group one
    vectored read into every range's place; a range with an unneeded whole block before the next is read on its
    own. Into a device every range is a part of its own (it goes through a staging buffer)."""
    g = _Strided.of(ref, item, dest, span)
    seg = g.c1 - g.c0
    block = ref.unit_bytes
    step = max(block, chunk_bytes // block * block)
    flat = dest.reshape(-1).view(torch.uint8)
    merged: list[list[int]] = []  # [source byte, destination byte, length]
    for s in range(g.s0, g.s1):
        a, t = s * g.src_sub + g.c0, g.dest_at(s)
        last = merged[-1] if merged else None
        if last is not None and last[0] + last[2] == a and last[1] + last[2] == t:
            last[2] += seg
        else:
            merged.append([a, t, seg])
    ranges = []
    for a, t, n in merged:
        while n > 0:
            cut = min(n, (a // step + 1) * step - a)
            ranges.append((a, t, cut))
            a, t, n = a + cut, t + cut, n - cut
    cpu = not stages(dest)
    out: list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]] = []
    group: list[tuple[int, int, int]] = []

    def flush() -> None:
        fetched = _blocks_around(ref, group[0][0], group[-1][0] + group[-1][2])
        fill: Callable[[torch.Tensor], bool]
        if len(group) == 1:
            a, t, n = group[0]
            fill, target = functools.partial(bytes_into, ref, a, a + n), flat[t : t + n]
        else:
            views = [(a, flat[t : t + n].numpy().data) for a, t, n in group]
            fill, target = functools.partial(_fill_segments, segments_into, ref, views), flat
        out.append((fetched, fill, target))

    for a, t, n in ranges:
        if group:
            start, end = group[0][0], group[-1][0] + group[-1][2]
            last_block = (end - 1) // block
            joins = a // block == last_block or (a // block == last_block + 1 and end - start < chunk_bytes)
            if not cpu or not joins:
                flush()
                group = []
        group.append((a, t, n))
    if group:
        flush()
    return out


def _fill_segments(segments_into: SegmentsInto, ref: PieceRef, views: list[tuple[int, memoryview]], target) -> bool:
    """A part of scattered ranges: read into ``views`` (of ``target``, the whole destination)."""
    del target
    return segments_into(ref, views)


def _copied_parts(
    ref: PieceRef, item: ReadItem, dest: torch.Tensor, span: RowSpan, bytes_into: ReadInto
) -> list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]]:
    """The parts of a span of short ranges (CPU only): the file bytes from the first range to the last, cut at
    checksum blocks about every :data:`COPY_PART_BYTES`, each part read (verified) into the thread's reused
    buffer and copied from it into every range's place, one strided copy for the rows it holds whole."""
    g = _Strided.of(ref, item, dest, span)
    flat = dest.reshape(-1).view(torch.uint8)
    step = max(ref.unit_bytes, COPY_PART_BYTES // ref.unit_bytes * ref.unit_bytes)
    lo, hi = g.s0 * g.src_sub + g.c0, (g.s1 - 1) * g.src_sub + g.c1
    out: list[tuple[int, Callable[[torch.Tensor], bool], torch.Tensor]] = []
    a = lo
    while a < hi:
        b = min(hi, (a // step + 1) * step)
        out.append((_blocks_around(ref, a, b), functools.partial(_copy_through_buffer, bytes_into, ref, a, b, g), flat))
        a = b
    return out


def _copy_through_buffer(bytes_into: ReadInto, ref: PieceRef, a: int, b: int, g: _Strided, flat: torch.Tensor) -> bool:
    """Read bytes ``[a, b)`` of ``ref`` into this thread's buffer (verified), then copy every range they hold
    into ``flat`` (the destination's bytes)."""
    buf = thread_buffer(b - a)
    if not bytes_into(ref, a, b, buf):
        return False
    seg = g.c1 - g.c0
    # sub-rows overlapping [a, b), and those inside it whole
    first = max(g.s0, (a - g.c1) // g.src_sub + 1)
    last = min(g.s1, -(-(b - g.c0) // g.src_sub))
    whole_lo = max(first, -(-(a - g.c0) // g.src_sub))
    whole_hi = min(last, (b - g.c1) // g.src_sub + 1)
    if whole_hi > whole_lo:
        n = whole_hi - whole_lo
        src = buf.as_strided((n, seg), (g.src_sub, 1), buf.storage_offset() + whole_lo * g.src_sub + g.c0 - a)
        dst = flat.as_strided((n, seg), (g.dest_sub, 1), flat.storage_offset() + g.dest_at(whole_lo))
        dst.copy_(src)
    for s in {first, last - 1}:
        if whole_lo <= s < whole_hi or not first <= s < last:
            continue
        x, y = max(a, s * g.src_sub + g.c0), min(b, s * g.src_sub + g.c1)
        at = g.dest_at(s) + x - (s * g.src_sub + g.c0)
        flat[at : at + y - x].copy_(buf[x - a : y - a])
    return True


def _staged(target: torch.Tensor | Scatter | Run) -> bool:
    """Whether a part lands through staging: scattered rows always, a run or a view where its memory stages."""
    if isinstance(target, Run):
        return target.staged
    return isinstance(target, Scatter) or stages(target)


def read_in_place(
    chunks: ChunkReader,
    jobs: Sequence[Job],
    threads: int,
    chunk_bytes: int,
    stage_bytes: int = LOAD_STAGE_BYTES,
    mapped_bytes: int = LOAD_MAPPED_BYTES,
    checksums_on_device: bool = False,
) -> tuple[set[int], int]:
    """Read each job (a read of one stored piece: full-width rows, one byte range per row, or rows scattered into
    place) into its destination by ``threads`` threads, in parts of the chunk grid (rows; parts of about
    ``stage_bytes`` through staging, ``mapped_bytes`` copied from page-locked mappings) or row by row (byte
    ranges); returns the positions the session could not read in place (the caller assembles them) and the bytes
    fetched for the others.

    Into a GPU where Triton runs (``checksums_on_device``), parts that are whole checksum blocks are read unhashed
    and hashed where they land (:mod:`.device_checks`); the load raises at its end if one differs. Else, into a
    device whose driver page-locks file mappings (:mod:`.page_lock`; ``mapped_bytes`` 0: never), parts of whole
    stored rows are copied to the device from the page cache itself; the others stage."""
    # A session that cannot read in place lacks the method: its jobs are handed back (``failed``).
    no_read: ReadInto = _cannot_read
    rows_into: ReadInto = getattr(chunks.pieces, "read_rows_into", no_read)
    bytes_into: ReadInto = getattr(chunks.pieces, "read_bytes_into", no_read)
    segments_into: SegmentsInto = getattr(chunks.pieces, "read_segments_into", _cannot_read_segments)
    columns_into: ColumnsInto | None = getattr(chunks.pieces, "read_columns_into", None)
    spans_ok = bytes_into is not no_read and segments_into is not _cannot_read_segments
    usable = [j for j in jobs if (spans_ok if isinstance(j[3], RowSpan) else rows_into is not no_read)]
    failed = set().union(*map(positions, jobs)) - set().union(*map(positions, usable))
    if not usable:
        return failed, 0
    # the device the staged destinations are on (None: every destination is host memory, nothing stages)
    device = next((job[2].device for job in usable if stages(job[2])), None)
    blocks_into: ReadInto | None = getattr(chunks.pieces, "read_blocks_into", None)
    checks = _device_checks(chunks, device) if checksums_on_device and blocks_into is not None else None
    # hashed on the device, a part is read once into pinned memory: as cheap for the host as locking its pages
    mapped = _mapped_rows(chunks, device, mapped_bytes) if checks is None else None
    local = threading.local()
    stagers: list[Stager] = []
    lock = threading.Lock()
    run_into: RunInto | None = getattr(chunks.pieces, "read_pieces_into", None)
    # parts: (positions, fetched bytes, fill(target) -> bool, destination view, Scatter or Run, whole rows read)
    parts: list[tuple[set[int], int, Callable[[torch.Tensor], bool], torch.Tensor | Scatter | Run, Rows | None]] = []
    # pieces read whole into contiguous views, host and staged apart: the small ones are coalesced below
    whole: dict[bool, list[tuple[set[int], PieceRef, torch.Tensor]]] = {False: [], True: []}
    for job in usable:
        pos, item, dest, span = job
        ref = chunks.ref(item.tensor, item.src_box)
        staged = stages(dest)
        grid = stage_bytes if staged else chunk_bytes
        # a small piece read whole joins a run; a larger one is read in parts on the grid below, by several threads
        if run_into is not None and is_small(ref, stage_bytes) and (view := whole_piece_view(ref, job)) is not None:
            whole[staged].append((positions(job), ref, view))
        elif isinstance(span, RowsGroup):
            parts += [(span.positions, *part) for part in scatter_parts(ref, span, grid, rows_into)]
        elif span is None:
            r0, r1 = item.rows
            # rows that land as they are need no device scratch: copied from page-locked mappings, in larger parts
            # (a part's registration costs per call as well as per byte); scattered rows keep the staging grid,
            # which bounds each fill thread's device scratch
            per = max(
                1,
                chunk_rows(ref.box, ref.dtype, mapped_bytes if staged and mapped is not None else grid, ref.unit_bytes),
            )
            # parts on the chunk grid: every thread gets work, no checksum block is read twice
            for lo, hi in grid_spans(r0, r1, per):
                fill = functools.partial(rows_into, ref, lo, hi)
                parts.append(({pos}, fetched_bytes(ref, lo, hi), fill, dest[lo - r0 : hi - r0], Rows(ref, lo, hi)))
        elif columns_into is not None and sliced_columns(ref, span):
            parts += [({pos}, *part, None) for part in _column_parts(ref, item, dest, span, grid, columns_into)]
        else:
            if span.c1 - span.c0 >= VECTORED_RANGE_BYTES or staged:
                found = _vectored_parts(ref, item, dest, span, grid, bytes_into, segments_into)
            else:
                found = _copied_parts(ref, item, dest, span, bytes_into)
            parts += [({pos}, *part, None) for part in found]
    for some in whole.values():
        if not some or run_into is None:  # whole pieces are only gathered where the session reads runs
            continue
        runs, alone = coalesce(some, stage_bytes, run_into)
        parts += [(*run, None) for run in runs]
        for i in alone:
            where, ref, view = some[i]
            rows = Rows(ref, 0, ref.box.shape[0])
            fill = functools.partial(rows_into, *rows)
            parts.append((where, fetched_bytes(*rows), fill, view, rows))
    # the staging buffers' size: the largest staged part (parts of whole rows are copied from mappings instead)
    part_bytes = max(
        (staged_bytes(t) for *_, t, rows in parts if _staged(t) and (rows is None or mapped is None)), default=0
    )

    def run(fill: Callable[[torch.Tensor], bool], dest: torch.Tensor | Scatter | Run, rows: Rows | None) -> bool:
        if not _staged(dest):
            return fill(dest)  # type: ignore[arg-type]
        stager = getattr(local, "stager", None)
        if stager is None:
            stager = local.stager = Stager(part_bytes, dest.device)
            with lock:
                stagers.append(stager)
        if rows is not None and not isinstance(dest, Run):
            if checks is not None and blocks_into is not None and DeviceChecks.takes(*rows):
                return stager.read(
                    functools.partial(blocks_into, *rows), dest, functools.partial(checks.add, rows=rows)
                )
            found = mapped.open(rows) if mapped is not None else None
            if found is not None:
                stager.copy_mapped(*found, dest)
                return True
        return stager.read(fill, dest)

    fetched_total = 0
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-fill") as pool:
            futures = [(where, nbytes, pool.submit(run, fill, dest, rows)) for where, nbytes, fill, dest, rows in parts]
            for where, nbytes, fut in futures:
                if fut.result():
                    fetched_total += nbytes
                else:
                    failed |= where
    finally:
        for stager in stagers:  # every thread has stopped: its last copies end before its buffers (and mappings) go
            stager.finish()
    if checks is not None:
        checks.verify()  # every stream has finished: the digests the device computed are final
    return failed, fetched_total


def _device_checks(chunks: ChunkReader, device: torch.device | None) -> DeviceChecks | None:
    """The load's checksums computed on ``device`` (its staged destinations'), where the kernel runs there; else
    None (hashed on the host)."""
    accumulate = None if device is None else device_checks.accumulator_for(device)
    if accumulate is None:
        return None
    storage = getattr(chunks.pieces, "storage", None)
    return DeviceChecks(accumulate, getattr(storage, "path", str))


def _mapped_rows(chunks: ChunkReader, device: torch.device | None, mapped_bytes: int) -> MappedRows | None:
    """The load's copies from page-locked mappings, where its staged destinations are on ``device``, whose driver
    registers mappings, and the session maps its files; else None (every part stages)."""
    map_rows_bytes = getattr(chunks.pieces, "map_rows_bytes", None)
    if not mapped_bytes or device is None or map_rows_bytes is None:
        return None
    registrar = page_lock.registrar_for(device)
    return None if registrar is None else MappedRows(map_rows_bytes, registrar)
