"""The memory tier's host buffers *are* its checkpoint files: a ring of pre-laid-out safetensors files in the node's
memory directory (``/dev/shm``), mapped once, registered as pinned memory, into which the snapshot's
device-to-host copy lands directly.

Each rank keeps ``slots`` files ``<run root>/<node>.ring/rank-NNNNN/slot-K.safetensors``, each already the exact
size and layout of the file this rank writes (a header of fixed length, then every piece's bytes where the header
will say they are): the header's length does not depend on the checksum values, only on how many there are. A
memory save then

1. takes a slot (:meth:`MemoryRing.acquire`, on the training thread): the free one, else the one holding the oldest
   step; if that step's directory still links the slot's file, the link is removed first, so that step is no longer
   complete on this node before a byte of it changes (the newest complete slot is never the one written);
2. copies the rank's pieces straight into the slot's tensors (a non-blocking device-to-host copy into pinned,
   mapped memory: no second host copy, no new page);
3. off the training thread, hashes the slot's checksum blocks with a few threads and writes the header in place
   (:meth:`MemoryRing.finish`), then hard-links the slot's file into the step's staging directory: the ordinary
   commit (:mod:`moeckpt.reshard.save_protocol`) renames that into place. The file is byte-identical to what the
   safetensors writer makes of the same pieces in the slot's order: widest dtype first, so that every piece is
   aligned to its element size and the copy lands in a view of the mapping, never in a buffer of its own.

A persistent save of the same step reads the same slot (the slot stays *busy* until it is written), so ``slots`` is
``--memory-keep`` plus one: the newest complete checkpoints, and one slot free while a persistent write of another
is in flight.

The ring is allocated when the trainer attaches the memory tier, before the resume, and a restarted process maps
the slot files that survived it (``/dev/shm`` outlives the workers) instead of allocating: the first save after a
restart does not wait for buffers. Files of the wrong size (a new layout) are replaced by a rename, never written
over, so a committed checkpoint that links one stays intact for the resume.

Pinned registration is ``cudaHostRegister`` through ``torch.cuda.cudart()`` where the state lives on a CUDA GPU,
done by a thread while the model loads and the resume runs.
Where it is not available or refused (no CUDA, a ROCm build whose runtime does not register file-backed mappings, a
kernel or container that refuses to lock the pages: ``RLIMIT_MEMLOCK``), the ring is used unpinned, logged once:
the copy into it is then a synchronous pageable copy, still into the checkpoint file itself.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backends.safetensors import file_name
from moeckpt.formats.backends.safetensors_header import block_count, header_bytes, piece_block, slicing
from moeckpt.formats.box import Box
from moeckpt.formats.checksum import checksum
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import FileEntry, TensorEntry
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES, Piece
from moeckpt.formats.slices import slice_checksums

if TYPE_CHECKING:
    from moeckpt.formats.backend import Backend
    from moeckpt.formats.storage import Storage

__all__ = ["FORMAT", "MemoryRing", "RingStats", "RingWriter"]

log = logging.getLogger(__name__)

#: the file format the ring lays out in advance (the memory tier uses the ring only with this backend).
FORMAT = "safetensors"
_PLACEHOLDER = checksum(b"")


@dataclass
class RingStats:
    """What the ring did, for logs and benchmarks."""

    slots: int = 0
    bytes_per_slot: int = 0
    #: slots mapped from files a previous process left (no allocation).
    remapped: int = 0
    #: slots allocated and faulted in by this process.
    allocated: int = 0
    #: seconds spent allocating or mapping, at attach time.
    open_s: float = 0.0
    #: whether the slots are registered as pinned memory, and if not, why.
    pinned: bool = False
    unpinned_why: str | None = None
    #: seconds the background registration took (beside the model's load, off the training path).
    pin_s: float = 0.0


@dataclass
class _Slot:
    path: str
    mm: mmap.mmap
    base: torch.Tensor  # the whole file as uint8, over the mapping
    views: dict[tuple[str, Box], torch.Tensor]
    step: int | None = None
    busy: bool = False
    pinned_ptr: int | None = None


class MemoryRing:
    """One rank's ring of slot files; see the module docstring."""

    def __init__(
        self,
        directory: str,
        rank: int,
        layout: Sequence[tuple[str, Box]],
        tensors: dict[str, TensorEntry],
        *,
        slots: int,
        pin: bool,
        node_dir: str,
    ) -> None:
        import time

        if slots < 2:
            raise MoeckptError(f"a memory ring needs at least 2 slots, got {slots}")
        t0 = time.perf_counter()
        self.directory = directory
        self.rank = rank
        self.node_dir = node_dir
        self.name = file_name(rank)
        self.tensors = tensors
        # Widest dtype first: the data start is 8-byte aligned and every piece's size is a multiple of its itemsize,
        # so each piece then starts at a multiple of its own itemsize and is a view of the mapping. In the order
        # given, one odd-sized piece (a bf16 vector of 17 experts) would misalign every wider piece after it, and a
        # misaligned piece can only be copied through pageable memory of its own (slow, and faulted in per slot).
        # The order of the pieces in a file is the writer's choice (docs/format.md).
        present = [(t, b) for t, b in layout if not b.is_empty()]
        self.layout = sorted(present, key=lambda tb: -dtypes.itemsize(tensors[tb[0]].dtype))
        blocks = [_blocks(b, tensors[t]) for t, b in self.layout]
        self._placeholder = header_bytes(
            [(t, b, [_PLACEHOLDER] * n) for (t, b), n in zip(self.layout, blocks)], tensors
        )
        offsets, at = [], len(self._placeholder)
        for t, b in self.layout:
            n = b.numel * dtypes.itemsize(tensors[t].dtype)
            offsets.append((at, n))
            at += n
        self._offsets = offsets
        self.size = at
        self._all = {(t, b): torch.empty(b.shape, dtype=dtypes.to_torch(tensors[t].dtype)) for t, b in layout}
        self._lock = threading.Lock()
        self.stats = RingStats(slots=slots, bytes_per_slot=self.size)
        os.makedirs(directory, exist_ok=True)
        self._slots = [self._open(os.path.join(directory, f"slot-{k}.safetensors")) for k in range(slots)]
        self._find_steps()
        self._pinning: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_threads = 0
        if pin:
            # Registering the slots takes seconds for a large state: a thread does it
            # while the model loads and the resume runs, so a restart's first step does not wait for it; a snapshot
            # before it is done is a pageable copy, correct and slower.
            device = torch.cuda.current_device()
            self._pinning = threading.Thread(
                target=self._pin_in_background, args=(device,), daemon=True, name="moeckpt-ring-pin"
            )
            self._pinning.start()
        else:
            self._pin(False)
        self.stats.open_s = time.perf_counter() - t0
        log.debug(
            "memory ring of rank %d: %d slots of %.1f MB in %s (%d mapped from before, %d allocated, %s) in %.2f s",
            rank,
            slots,
            self.size / 1e6,
            directory,
            self.stats.remapped,
            self.stats.allocated,
            "being pinned" if pin else f"not pinned: {self.stats.unpinned_why}",
            self.stats.open_s,
        )

    # -- set-up ---------------------------------------------------------------------------------------------
    def _open(self, path: str) -> _Slot:
        fresh = not (os.path.isfile(path) and os.path.getsize(path) == self.size and self._header_fits(path))
        if fresh:
            # A new file renamed over the old name: a committed step that links the old one keeps it whole.
            tmp = f"{path}.new"
            with open(tmp, "wb") as f:
                f.truncate(self.size)
            os.replace(tmp, path)
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, max(1, self.size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        base = torch.frombuffer(mm, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)
        if fresh:
            base[: len(self._placeholder)] = torch.frombuffer(bytearray(self._placeholder), dtype=torch.uint8)
            base[len(self._placeholder) :].zero_()  # fault every page in now, not during the first save
            self.stats.allocated += 1
        else:
            self.stats.remapped += 1
        views = dict(self._all)
        for (t, b), (off, n) in zip(self.layout, self._offsets):
            dtype = dtypes.to_torch(self.tensors[t].dtype)
            if off % max(1, dtype.itemsize):  # never: the layout is ordered widest dtype first
                raise MoeckptError(f"{path}: piece {t} {b} at offset {off} is not aligned to its {dtype}")
            views[(t, b)] = base[off : off + n].view(dtype).view(b.shape)
        return _Slot(path=path, mm=mm, base=base, views=views)

    def _header_fits(self, path: str) -> bool:
        """A surviving slot file is reused when its header has this layout's length and prefix (its checksums are
        rewritten at every save)."""
        with open(path, "rb") as f:
            head = f.read(len(self._placeholder))
        return len(head) == len(self._placeholder) and head[:8] == self._placeholder[:8]

    def _pin(self, pin: bool) -> None:
        if not pin:
            self.stats.unpinned_why = "the state is not on a CUDA device"
            return
        try:
            cudart = torch.cuda.cudart()
            # in the order acquire() takes them (free first, then the oldest step): the first save of a restarted
            # process finds its slot registered while the others still are being registered
            with self._lock:
                order = sorted(range(len(self._slots)), key=self._age)
            for k in order:
                slot = self._slots[k]
                _populate(slot.mm)
                ptr = slot.base.data_ptr()
                code = int(cudart.cudaHostRegister(ptr, self.size, 0))
                if code != 0:
                    raise RuntimeError(f"cudaHostRegister returned {code}")
                slot.pinned_ptr = ptr
            self.stats.pinned = True
        except Exception as e:  # noqa: BLE001 - any refusal falls back to pageable copies, logged
            self._unpin()
            self.stats.unpinned_why = f"{type(e).__name__}: {e}"
            log.warning(
                "memory ring: the slot files could not be registered as pinned memory (%s); device-to-host copies "
                "into them are pageable (slower, synchronous) copies",
                self.stats.unpinned_why,
            )

    def _pin_in_background(self, device: int) -> None:
        """Register every slot as pinned memory; ``stats.pin_s`` is how long it took.

        No warm-up follows: a first device-to-host copy into a freshly registered mapping, a restarted process's
        included, runs at the rate of ``cudaHostAlloc`` memory (``benchmarks/probe_pinned_gpu.py``), so a DMA pass
        over every slot would only take the copy engine from the load running beside it."""
        import time

        t0 = time.perf_counter()
        torch.cuda.set_device(device)
        self._pin(True)
        self.stats.pin_s = time.perf_counter() - t0
        log.info(
            "memory ring of rank %d: %d slots of %.1f MB %s in %.2f s",
            self.rank,
            len(self._slots),
            self.size / 1e6,
            "registered as pinned memory" if self.stats.pinned else "left unpinned",
            self.stats.pin_s,
        )

    def _unpin(self) -> None:
        for slot in self._slots:
            if slot.pinned_ptr is not None:
                try:
                    torch.cuda.cudart().cudaHostUnregister(slot.pinned_ptr)
                except Exception:  # noqa: BLE001 - closing: nothing more to do
                    pass
                slot.pinned_ptr = None

    def _find_steps(self) -> None:
        """Which committed step of this node links each slot's file (after a restart)."""
        inodes = {os.stat(s.path).st_ino: s for s in self._slots}
        try:
            names = os.listdir(self.node_dir)
        except FileNotFoundError:
            return
        for name in names:
            if not name.startswith("step-") or not name[5:].isdigit():
                continue
            try:
                ino = os.stat(os.path.join(self.node_dir, name, self.name)).st_ino
            except FileNotFoundError:
                continue
            if ino in inodes:
                inodes[ino].step = int(name[5:])

    def slot_pinned(self, k: int) -> bool:
        """Whether slot ``k`` is registered as pinned memory now (a copy into it runs at the pinned rate)."""
        return self._slots[k].pinned_ptr is not None

    @property
    def pinning(self) -> bool:
        """Whether the background registration is still running (a copy into a slot not yet registered is a
        pageable one)."""
        return self._pinning is not None and self._pinning.is_alive()

    # -- saving ---------------------------------------------------------------------------------------------
    def acquire(self, step: int) -> int | None:
        """A slot for ``step`` (training thread): a free one, else the one holding the oldest step, never a busy
        one; ``None`` when every slot is busy. The slot's old step is unlinked from its directory first."""
        with self._lock:
            free = [k for k, s in enumerate(self._slots) if not s.busy]
            if not free:
                return None
            k = min(free, key=self._age)
            slot = self._slots[k]
            slot.busy = True
            old, slot.step = slot.step, None
        if old is not None:
            self._unlink(old, slot)
        return k

    def _age(self, k: int) -> int:
        """Slot ``k``'s step, for choosing the oldest (a free slot, -1, first)."""
        step = self._slots[k].step
        return -1 if step is None else step

    def _unlink(self, step: int, slot: _Slot) -> None:
        link = os.path.join(self.node_dir, f"step-{step:08d}", self.name)
        try:
            if os.stat(link).st_ino == os.stat(slot.path).st_ino:
                os.unlink(link)  # that step is no longer complete on this node before its bytes change
        except FileNotFoundError:
            pass  # pruned already

    def views(self, k: int) -> dict[tuple[str, Box], torch.Tensor]:
        """Slot ``k``'s tensor for each ``(tensor, box)`` of this rank's layout (empty boxes: small tensors)."""
        return self._slots[k].views

    def holds(self, k: int, pieces: Sequence[Piece]) -> bool:
        """Whether ``pieces`` are slot ``k``'s own tensors (the snapshot landed in it)."""
        views = self._slots[k].views
        return all(views.get((p.tensor, p.box)) is p.data for p in pieces if not p.box.is_empty())

    def finish(self, k: int, pieces: Sequence[Piece], *, threads: int = 1) -> FileEntry:
        """Make slot ``k`` a complete file of ``pieces``: copy in any piece that is not already its own, hash the
        checksum blocks with ``threads`` threads and write the header over the placeholder; returns its entry."""
        slot = self._slots[k]
        if len(pieces) != len(self._all) or {(p.tensor, p.box) for p in pieces} != set(self._all):
            raise MoeckptError(f"{slot.path}: the pieces to save are not this ring's layout (rank {self.rank})")
        for p in pieces:
            key = (p.tensor, p.box)
            if p.box.is_empty():
                continue
            if slot.views[key] is not p.data:
                slot.views[key].copy_(p.data)
        raw = memoryview(slot.mm) if self.size else memoryview(b"")
        # a job per checksum block; a piece sliced along its TP dimension (format version 5) is one job of its own
        geoms = [slicing(b, self.tensors[t]) for t, b in self.layout]
        sizes = [piece_block(b, self.tensors[t]) for t, b in self.layout]
        jobs = [
            (i, lo, min(lo + sizes[i], off + n) if geoms[i] is None else off + n)
            for i, (off, n) in enumerate(self._offsets)
            for lo in (range(off, off + n, sizes[i]) if n and geoms[i] is None else [off])
        ]

        def one(job: tuple[int, int, int]) -> list[str]:
            geom = geoms[job[0]]
            if geom is None:
                return [checksum(raw[job[1] : job[2]])]
            return slice_checksums(raw[job[1] : job[2]], geom)

        if threads > 1 and len(jobs) > 1 and self.size > 2 * CHECKSUM_BLOCK_BYTES:
            # One pool for the ring's life: a pool made per save costs the commit a few ms of thread starts, more
            # than hashing a small state takes on one thread (which is why a small one is hashed inline).
            digests = list(self._hash_pool(threads).map(one, jobs))
        else:
            digests = [one(j) for j in jobs]
        sums: list[list[str]] = [[] for _ in self.layout]
        for (i, _, _), d in zip(jobs, digests):
            sums[i].extend(d)
        head = header_bytes([(t, b, s) for (t, b), s in zip(self.layout, sums)], self.tensors)
        if len(head) != len(self._placeholder):
            raise MoeckptError(f"{slot.path}: the header changed length after hashing ({len(head)} bytes)")
        slot.mm[: len(head)] = head
        if self.size:
            raw.release()  # else the mapping could not be closed
        return FileEntry(path=self.name, size=self.size, checksum=checksum(head))

    def _hash_pool(self, threads: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_threads != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-ring-hash")
            self._pool_threads = threads
        return self._pool

    def link(self, k: int, directory: str) -> None:
        """Hard-link slot ``k``'s file into ``directory`` (a step's staging directory) under this rank's name."""
        target = os.path.join(directory, self.name)
        if os.path.lexists(target):
            os.unlink(target)
        os.link(self._slots[k].path, target)

    def committed(self, k: int, step: int) -> None:
        """Slot ``k`` now holds the committed ``step`` (still busy until :meth:`release`)."""
        self._slots[k].step = step

    def release(self, k: int) -> None:
        """Slot ``k``'s writes (memory commit, persistent save) have ended: it may be taken again."""
        with self._lock:
            self._slots[k].busy = False

    def close(self) -> None:
        """Unregister and unmap (the files stay, for the next process of the run)."""
        if self._pinning is not None:
            self._pinning.join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._unpin()
        for slot in self._slots:
            slot.views = {}
            slot.base = torch.empty(0, dtype=torch.uint8)
            try:
                slot.mm.close()
            except BufferError:
                pass  # a tensor still views it: the mapping goes with that tensor


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later; the mmap module names it from Python 3.13 on).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mm: mmap.mmap) -> None:
    """Fill a slot's page tables before it is registered. ``cudaHostRegister`` of a mapping whose pages are not yet
    in this process's page tables (a restarted process's surviving files) faults them in itself while holding the
    driver, so every CUDA call of the load and the first step beside it waits for all of it; populated first, off
    the driver, the registration takes a fraction of that (docs/benchmarks/gpu.md). Where the call is refused (an older
    kernel, not Linux) the registration faults the pages in, as before."""
    try:
        mm.madvise(_MADV_POPULATE_WRITE)
    except (OSError, ValueError) as e:
        log.debug("memory ring: populating a slot's page tables failed (%s); the registration will fault them in", e)


def _blocks(box: Box, entry: TensorEntry) -> int:
    return block_count(box, entry)


class RingWriter:
    """The backend a memory save with a ring slot writes through: this rank's file is the slot (hashed, its header
    written in place, linked into the staging directory); the rest is the tier's backend."""

    def __init__(self, ring: MemoryRing, slot: int, backend: Backend) -> None:
        self.ring, self.slot, self.backend = ring, slot, backend

    def prepare(self, storage: Storage, tensors, boxes) -> None:
        self.backend.prepare(storage, tensors, boxes)

    def write(self, storage: Storage, writer: int, pieces, tensors, *, threads: int = 1) -> list[FileEntry]:
        del writer, tensors  # the ring's own: this rank's layout
        entry = self.ring.finish(self.slot, pieces, threads=threads)
        self.ring.link(self.slot, storage.path())
        return [entry]

    def finish(self, storage: Storage, files: list[FileEntry], tensors) -> list[FileEntry]:
        return self.backend.finish(storage, files, tensors)
