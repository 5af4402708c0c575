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

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from moeckpt.formats.pieces import PieceRef, fetched_bytes

from .chunks import ChunkReader, chunk_rows
from .planner import ReadItem

ReadInto = Callable[[PieceRef, int, int, torch.Tensor], bool]


class Stager:
    """A thread's two reused staging buffers (pinned where the device has a host-to-device path) and its copy
    stream: :meth:`read` fills ``dest`` with rows read into a buffer, then copied from it asynchronously."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device
        accel = device.type != "cpu"
        pin = accel and torch.cuda.is_available()
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events: list = [None, None]
        self.turn = 0

    def read(self, into: ReadInto, ref: PieceRef, lo: int, hi: int, dest: torch.Tensor) -> bool:
        """Rows ``[lo, hi)`` of ``ref`` into ``dest`` (on the device) through the next staging buffer."""
        k = self.turn
        self.turn ^= 1
        if self.events[k] is not None:
            self.events[k].synchronize()  # the copy out of this buffer has finished: it may be filled again
        nbytes = dest.numel() * dest.element_size()
        stage = self.buffers[k][:nbytes].view(dest.dtype).view(dest.shape)
        if not into(ref, lo, hi, stage):
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


def read_in_place(
    chunks: ChunkReader,
    jobs: Sequence[tuple[int, ReadItem, torch.Tensor]],
    threads: int,
    chunk_bytes: int,
) -> tuple[set[int], int]:
    """Read each ``(position, read, destination)`` of ``jobs`` (a full-width row read of one stored piece) into
    its destination by ``threads`` threads, in parts of the chunk grid; returns the positions the session could
    not read in place (the caller assembles them) and the bytes fetched for the others."""
    into: ReadInto | None = getattr(chunks.pieces, "read_rows_into", None)
    if into is None or not jobs:
        return {pos for pos, _, _ in jobs}, 0
    local = threading.local()
    stagers: list[Stager] = []
    lock = threading.Lock()

    def part(ref: PieceRef, lo: int, hi: int, dest: torch.Tensor) -> bool:
        if dest.device.type == "cpu":
            return into(ref, lo, hi, dest)
        stager = getattr(local, "stager", None)
        if stager is None:
            stager = local.stager = Stager(part_bytes, dest.device)
            with lock:
                stagers.append(stager)
        return stager.read(into, ref, lo, hi, dest)

    part_bytes = 0
    plan: list[tuple[int, PieceRef, int, int, torch.Tensor]] = []
    for pos, item, dest in jobs:
        ref = chunks.ref(item.tensor, item.src_box)
        r0, r1 = item.rows
        per = max(1, chunk_rows(ref.box, ref.dtype, chunk_bytes, ref.block_bytes))
        row = ref.nbytes // ref.box.shape[0]
        lo = r0
        while lo < r1:  # parts on the chunk grid: every thread gets work, no checksum block is read twice
            hi = min(r1, (lo // per + 1) * per)
            plan.append((pos, ref, lo, hi, dest[lo - r0 : hi - r0]))
            part_bytes = max(part_bytes, (hi - lo) * row)
            lo = hi
    failed: set[int] = set()
    fetched = 0
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-fill") as pool:
            futures: list[tuple[int, int, Future]] = [
                (pos, fetched_bytes(ref, lo, hi), pool.submit(part, ref, lo, hi, dest))
                for pos, ref, lo, hi, dest in plan
            ]
            for pos, nbytes, fut in futures:
                if fut.result():
                    fetched += nbytes
                else:
                    failed.add(pos)
    finally:
        for stager in stagers:  # every thread has stopped: its last copies end before its buffers go
            stager.finish()
    return failed, fetched
