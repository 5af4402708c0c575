"""Loads into device memory through pinned staging: reads land in reused host buffers, then copy to the device.

Each fill thread of a device load owns a :class:`Stager`: two pinned buffers it reads into in turn and a copy
stream, so the read (and checksum) of one part overlaps the host-to-device copy of the one before. A part lands
in one of three ways:

* as it is stored, where its bytes are contiguous in the destination too (full-width rows of a stored piece, a
  contiguous byte range): one copy into the destination;
* *scattered*, where the destination takes a region of the rows read (the expert halves and ZeRO parts of a
  stored layout joined into fewer ranks, the TP halves of a matrix joined along its columns, a TP slice of rows
  narrower than a checksum block): the whole rows go to a device scratch buffer in one copy, and a device-side
  copy puts the region in place. No host-side assembly, no pageable copy;
* as a *run*: small stored pieces that lie back to back in a file (norms, biases, routers: most of a model's
  pieces, little of its bytes) read in one vectored read, each verified, then copied to their own destinations.
  Host loads read runs too, straight into the pieces' tensors (:func:`coalesce` serves both).

On a machine without a device the copies are plain host copies; :func:`stages` is what decides, so the tests
run the staged paths on the CPU too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.pieces import PieceRef, fetched_bytes

from .chunks import chunk_rows, grid_spans
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


class Run(NamedTuple):
    """A coalesced part: small stored pieces that lie back to back in one file, ``nbytes`` from the first's
    start to the last's end, read in one vectored read (each piece verified) straight into their destinations,
    or into a staging buffer and copied from it (``staged``): ``lands`` are ``(dest, byte offset in the run)``."""

    nbytes: int
    lands: tuple[tuple[torch.Tensor, int], ...]
    staged: bool

    @property
    def device(self) -> torch.device:
        return self.lands[0][0].device


class Stager:
    """A thread's two reused staging buffers (pinned where the device has a host-to-device path), its copy stream
    and, for scattered parts, two device scratch buffers: :meth:`read` fills a destination with bytes read into
    a buffer, then copied from it asynchronously.

    Made and used by one thread: the copy stream is made that thread's current stream once, and the two events
    that guard the buffers are reused (a part costs little more than its read and its copies, which matters
    because a load's parts take turns on the interpreter lock)."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        self.nbytes = nbytes
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        # made at the first staged part: a load whose parts are all copied from page-locked mappings pins nothing
        self.buffers: list[torch.Tensor] = []
        self.scratch: list[torch.Tensor | None] = [None, None]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's current context: what the driver's registrations take
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)  # this thread's current stream: every copy below goes on it
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        # per buffer turn: the releases of the page-locked mappings its copies read, due once they have finished
        self.pending: list[list[Callable[[], None]]] = [[], []]
        self.turn = 0

    def _next_turn(self) -> int:
        """The next of the two turns, once the copies of its previous part have finished."""
        k = self.turn
        self.turn ^= 1
        if self.used[k] and self.stream is not None:
            self.events[k].synchronize()  # the copies out of this buffer have finished: it may be filled again
        self._release(k)
        return k

    def _release(self, k: int) -> None:
        done, self.pending[k] = self.pending[k], []
        for release in done:
            release()

    def _copied(self, k: int) -> None:
        """The copies of turn ``k`` are queued: its buffer (and its mappings) are free once they have run."""
        if self.stream is not None:
            self.events[k].record(self.stream)
            self.used[k] = True
        else:
            self._release(k)  # host copies: done already

    def read(
        self,
        fill: Callable[[torch.Tensor], bool],
        dest: torch.Tensor | Scatter | Run,
        check: Callable[[torch.Tensor], None] | None = None,
    ) -> bool:
        """``fill(stage)`` reads bytes into the next staging buffer, viewed as ``dest`` (contiguous), as the rows
        of a :class:`Scatter` or as the bytes of a :class:`Run`; they are then copied to their place. ``check``
        (not for a run) is handed the rows' bytes where they landed (on the device: the destination, or the
        scratch they are scattered from), on this thread's stream after their copy."""
        k = self._next_turn()
        buffer = self._buffer(k, staged_bytes(dest))
        if isinstance(dest, Run):
            stage = buffer[: dest.nbytes]
        else:
            shape, dtype = (dest.shape, dest.dtype) if isinstance(dest, Scatter) else (tuple(dest.shape), dest.dtype)
            stage = buffer[: _numel(shape) * dtype.itemsize].view(dtype).view(shape)
        if not fill(stage):
            return False
        copy = self.stream is not None  # non-blocking copies from pinned memory on this thread's stream
        if isinstance(dest, Run):
            for to, at in dest.lands:  # as bytes: a piece's offset in the run need not align to its element size
                n = to.numel() * to.element_size()
                to.reshape(-1).view(torch.uint8).copy_(stage[at : at + n], non_blocking=copy)
        else:
            landed = self._land(stage, dest, k)
            if check is not None:
                check(landed)
        self._copied(k)
        return True

    def copy_mapped(self, host: torch.Tensor, release: Callable[[], None], dest: torch.Tensor | Scatter) -> None:
        """Land ``host`` (the bytes of whole rows, uint8, page-locked: :class:`~.page_lock.MappedRows`) in
        ``dest`` as :meth:`read` lands a staged part; ``release`` is called once the copies from it have run."""
        k = self._next_turn()
        try:
            self._land(host, dest, k)
        finally:
            self.pending[k].append(release)
            self._copied(k)

    def _land(self, stage: torch.Tensor, dest: torch.Tensor | Scatter, k: int) -> torch.Tensor:
        """Copy the rows in ``stage`` (host memory, contiguous: shaped as ``dest`` or its bytes) to their place, as
        bytes (a mapping's rows need not sit at an address aligned for their dtype); returns the rows' bytes where
        they landed whole (the device scratch of a scattered part, else the destination)."""
        copy = self.stream is not None
        flat = stage.view(torch.uint8).reshape(-1)
        if isinstance(dest, Scatter):
            landed = flat
            if copy:  # the whole rows to the device in one copy; the regions are cut out of them there
                landed = self._scratch(k, len(flat))[: len(flat)]
                landed.copy_(flat, non_blocking=True)
            rows = landed.view(dest.dtype).view(dest.shape)
            for to, pick in dest.lands:
                to.copy_(rows[(slice(None),) + pick], non_blocking=copy)
            return landed
        landed = dest.reshape(-1).view(torch.uint8)
        landed.copy_(flat, non_blocking=copy)
        return landed

    def _buffer(self, k: int, nbytes: int) -> torch.Tensor:
        if not self.buffers:
            self.buffers = [torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self.pin) for _ in range(2)]
        if len(self.buffers[k]) < nbytes:  # a part planned as a mapped copy and staged after all (a refusal)
            self.buffers[k] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        return self.buffers[k]

    def _scratch(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.scratch[k]
        if buf is None or len(buf) < nbytes:
            buf = self.scratch[k] = torch.empty(max(nbytes, self.nbytes), dtype=torch.uint8, device=self.device)
        return buf

    def finish(self) -> None:
        """Wait for this thread's copies, then release the mappings they read."""
        try:
            if self.stream is not None:
                self.stream.synchronize()
        finally:
            self._release(0)
            self._release(1)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def staged_bytes(dest: torch.Tensor | Scatter | Run) -> int:
    """The staging bytes a part of ``dest`` takes."""
    if isinstance(dest, Run):
        return dest.nbytes
    if isinstance(dest, Scatter):
        return _numel(dest.shape) * dest.dtype.itemsize
    return dest.numel() * dest.element_size()


class Rows(NamedTuple):
    """Rows ``[lo, hi)`` of stored piece ``ref``: what a part of whole stored rows reads, staged or copied from a
    page-locked mapping (:mod:`.page_lock`)."""

    ref: PieceRef
    lo: int
    hi: int


#: a staged part: (fetched bytes, fill(stage) -> bool, where it lands, the rows it reads where they are whole).
Part = tuple[int, Callable[[torch.Tensor], bool], "torch.Tensor | Scatter | Run", "Rows | None"]


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
    per = max(1, chunk_rows(ref.box, ref.dtype, stage_bytes, ref.unit_bytes))
    shape = tuple(group.src_box.shape[1:])
    where = []
    for _, item, dest in group.lands:
        in_dest = item.region.relative_to(item.target_box).slices()
        where.append((dest, in_dest[0].start, in_dest[1:], item.region.relative_to(item.src_box).slices()[1:]))
    whole = len(where) == 1 and group.lands[0][1].region.shape[1:] == group.src_box.shape[1:]
    parts: list[Part] = []
    for lo, hi in grid_spans(r0, r1, per):
        # destination row ``first`` holds stored row r0
        lands = tuple(
            (dest[(slice(first + lo - r0, first + hi - r0),) + cols], pick) for dest, first, cols, pick in where
        )
        fill = functools.partial(rows_into, ref, lo, hi)
        at = lands[0][0]
        target = at if whole and at.is_contiguous() else Scatter((hi - lo,) + shape, lands)
        parts.append((fetched_bytes(ref, lo, hi), fill, target, Rows(ref, lo, hi)))
    return parts


def whole_piece_view(ref: PieceRef, job) -> torch.Tensor | None:
    """Where a job that reads all of stored piece ``ref`` into one contiguous view puts it (that view), else None:
    whole rows of the piece landing as stored (``span`` None), or a group of its rows with one full-width region
    (an expert half or ZeRO part joined along rows)."""
    _, item, dest, span = job
    rows = ref.box.shape[0] if ref.box.ndim else 0
    if not rows or item.rows != (0, rows):
        return None
    if span is None:
        view = dest[: item.rows[1] - item.rows[0]]
    elif isinstance(span, RowsGroup) and len(span.lands) == 1 and item.region.shape[1:] == ref.box.shape[1:]:
        first = item.region.relative_to(item.target_box).offsets[0]
        view = dest[first : first + rows]
    else:
        return None
    return view if view.is_contiguous() and view.numel() * view.element_size() == ref.nbytes else None


#: a stored piece of at most this share of a stage part is coalesced with its neighbours in the file into one read.
SMALL_PIECE_SHARE = 4
#: pieces at most this many bytes apart in a file are read in one run (the bytes between are read and dropped).
RUN_GAP_BYTES = 4096

RunInto = Callable[[Sequence[PieceRef], Sequence[memoryview]], bool]


def is_small(ref: PieceRef, stage_bytes: int) -> bool:
    """Whether stored piece ``ref`` is small enough to be read in a run with its neighbours; larger pieces are read
    in parts on the chunk grid, by several threads."""
    return 0 < ref.nbytes <= max(1, stage_bytes // SMALL_PIECE_SHARE)


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data


def _read_run(run_into: RunInto, refs: Sequence[PieceRef], run: Run, target: torch.Tensor | Run) -> bool:
    """A run's read: into its destinations themselves (``target`` the run), or into the staging buffer
    ``target``, each piece at its offset in the run."""
    if isinstance(target, Run):
        return run_into(refs, [_bytes_of(dest) for dest, _ in run.lands])
    stage = _bytes_of(target)
    return run_into(refs, [stage[at : at + ref.nbytes] for ref, (_, at) in zip(refs, run.lands)])


def coalesce(
    whole: Sequence[tuple[set[int], PieceRef, torch.Tensor]], stage_bytes: int, run_into: RunInto
) -> tuple[list[tuple[set[int], int, Callable[[torch.Tensor], bool], Run]], list[int]]:
    """Runs of the small stored pieces among ``whole`` (each ``(positions, piece, destination view)``: the piece
    read whole into a contiguous view, every view staged or none) that lie back to back in one file, each run one
    part of at most ``stage_bytes``: one read and one checksum pass per piece instead of a part per piece, whose
    fixed cost (a read call; through staging a stream handover and an event) took the interpreter lock as often as
    there are pieces. Returns the runs' parts and the indices of ``whole`` left to a part of their own."""
    by_file: dict[str, list[int]] = {}
    alone = []
    for i, (_, ref, _) in enumerate(whole):
        if is_small(ref, stage_bytes):
            by_file.setdefault(ref.file, []).append(i)
        else:
            alone.append(i)
    runs: list[list[int]] = []
    for members in by_file.values():
        members.sort(key=lambda i: whole[i][1].start)
        for i in members:
            ref = whole[i][1]
            if runs and whole[runs[-1][0]][1].file == ref.file:
                first, last = whole[runs[-1][0]][1], whole[runs[-1][-1]][1]
                end = last.start + last.nbytes
                if end <= ref.start <= end + RUN_GAP_BYTES and ref.start + ref.nbytes - first.start <= stage_bytes:
                    runs[-1].append(i)
                    continue
            runs.append([i])
    parts: list[tuple[set[int], int, Callable[[torch.Tensor], bool], Run]] = []
    for run in runs:
        if len(run) == 1:
            alone.append(run[0])
            continue
        refs = [whole[i][1] for i in run]
        base = refs[0].start
        nbytes = refs[-1].start + refs[-1].nbytes - base
        lands = tuple((whole[i][2], whole[i][1].start - base) for i in run)
        where = set().union(*(whole[i][0] for i in run))
        target = Run(nbytes, lands, stages(lands[0][0]))
        parts.append((where, nbytes, functools.partial(_read_run, run_into, refs, target), target))
    return parts, sorted(alone)
