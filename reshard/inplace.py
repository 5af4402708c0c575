"""Boxes read straight into their destination: in place on the CPU, through pinned staging into device memory.

A box that is full-width rows of one stored piece is contiguous in the file and in its tensor, so it needs no
assembly: threads (``LoadOptions.fill_threads``; ``pread`` and the checksums release the interpreter lock) read
it in parts of the chunk grid, each part verified as it lands (``read_rows_into`` of the backend's session).
Into device memory (a GPU), each thread reads a part into one of its two reused pinned buffers and copies it to
the device on a stream of its own while it reads the next part into the other, so reads, checksums and
host-to-device copies overlap and no pageable copy is made. Without a device (CPU-only machines) the staging
copies are plain copies, which is what the tests run.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from moeckpt.formats.pieces import PieceRef, fetched_bytes

from .chunks import ChunkReader, chunk_rows
from .planner import ReadItem

ReadInto = Callable[[PieceRef, int, int, torch.Tensor], bool]


def _cannot_read(ref: PieceRef, lo: int, hi: int, out: torch.Tensor) -> bool:
    """The in-place read of a session that has none: reads nothing."""
    del ref, lo, hi, out
    return False


class Stager:
    """A thread's two reused staging buffers (pinned where the device has a host-to-device path) and its copy
    stream: :meth:`read` fills ``dest`` with bytes read into a buffer, then copied from it asynchronously."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        pin = device.type == "cuda" and torch.cuda.is_available()
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list = [None, None]
        self.turn = 0

    def read(self, fill: Callable[[torch.Tensor], bool], dest: torch.Tensor) -> bool:
        """``fill(stage)`` reads ``dest``'s bytes into the next staging buffer (viewed as ``dest``), which is then
        copied into ``dest`` (on the device)."""
        k = self.turn
        self.turn ^= 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copy out of this buffer has finished: it may be filled again
        nbytes = dest.numel() * dest.element_size()
        stage = self.buffers[k][:nbytes].view(dest.dtype).view(dest.shape)
        if not fill(stage):
            return False
        if self.stream is None:
            dest.copy_(stage)
            return True
        with torch.cuda.stream(self.stream):
            dest.copy_(stage, non_blocking=True)
            self.events[k] = torch.cuda.Event()
            self.events[k].record(self.stream)
        return True

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


#: a job: (position, the read, its destination, and None for whole rows, or (c0, c1, d0): bytes [c0, c1) of
#: each source row, landing at byte d0 of the matching row of the destination).
Job = tuple[int, ReadItem, torch.Tensor, "tuple[int, int, int] | None"]


def read_in_place(chunks: ChunkReader, jobs: Sequence[Job], threads: int, chunk_bytes: int) -> tuple[set[int], int]:
    """Read each job (a read of one stored piece: full-width rows, or one byte range per row) into its destination
    by ``threads`` threads, in parts of the chunk grid (rows) or row by row (byte ranges); returns the positions
    the session could not read in place (the caller assembles them) and the bytes fetched for the others."""
    # A session that cannot read in place lacks the method: its jobs are handed back (``failed``).
    no_read: ReadInto = _cannot_read
    rows_into: ReadInto = getattr(chunks.pieces, "read_rows_into", no_read)
    bytes_into: ReadInto = getattr(chunks.pieces, "read_bytes_into", no_read)
    usable = [j for j in jobs if (rows_into if j[3] is None else bytes_into) is not no_read]
    failed = {j[0] for j in jobs} - {j[0] for j in usable}
    if not usable:
        return failed, 0
    local = threading.local()
    stagers: list[Stager] = []
    lock = threading.Lock()
    part_bytes = 0
    # parts: (position, fetched bytes, fill(target) -> bool, destination view)
    parts: list[tuple[int, int, Callable[[torch.Tensor], bool], torch.Tensor]] = []
    for pos, item, dest, span in usable:
        ref = chunks.ref(item.tensor, item.src_box)
        r0, r1 = item.rows
        row = ref.nbytes // ref.box.shape[0]
        if span is None:
            per = max(1, chunk_rows(ref.box, ref.dtype, chunk_bytes, ref.block_bytes))
            lo = r0
            while lo < r1:  # parts on the chunk grid: every thread gets work, no checksum block is read twice
                hi = min(r1, (lo // per + 1) * per)
                fill = functools.partial(rows_into, ref, lo, hi)
                parts.append((pos, fetched_bytes(ref, lo, hi), fill, dest[lo - r0 : hi - r0]))
                part_bytes = max(part_bytes, (hi - lo) * row)
                lo = hi
        else:
            c0, c1, d0 = span
            item_bytes = dest.element_size()
            flat = dest.reshape(-1)
            dest_row = dest.numel() // dest.shape[0] * item_bytes
            first = item.region.offsets[0] - item.target_box.offsets[0]  # target row of source row r0
            for r in range(r0, r1):
                a, b = r * row + c0, r * row + c1
                start = ((first + r - r0) * dest_row + d0) // item_bytes
                block = ref.block_bytes
                fetched = min(-(-b // block) * block, ref.nbytes) - a // block * block
                target = flat[start : start + (c1 - c0) // item_bytes]
                parts.append((pos, fetched, functools.partial(bytes_into, ref, a, b), target))
                part_bytes = max(part_bytes, c1 - c0)

    def run(fill: Callable[[torch.Tensor], bool], dest: torch.Tensor) -> bool:
        if dest.device.type == "cpu":
            return fill(dest)
        stager = getattr(local, "stager", None)
        if stager is None:
            stager = local.stager = Stager(part_bytes, dest.device)
            with lock:
                stagers.append(stager)
        return stager.read(fill, dest)

    fetched_total = 0
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-fill") as pool:
            futures = [(pos, nbytes, pool.submit(run, fill, dest)) for pos, nbytes, fill, dest in parts]
            for pos, nbytes, fut in futures:
                if fut.result():
                    fetched_total += nbytes
                else:
                    failed.add(pos)
    finally:
        for stager in stagers:  # every thread has stopped: its last copies end before its buffers go
            stager.finish()
    return failed, fetched_total
