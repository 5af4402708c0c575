"""Executing reshard plans: reading source rows through a bounded cache, and the offline reshard loop.

Memory stays bounded by a few pieces, never by the checkpoint: target pieces are assembled and written in row
slabs (``slab_bytes``), source pieces are read in row chunks (``chunk_bytes``) through a cache with a byte budget,
and a safetensors target file is streamed to storage with its header written last
(:func:`moeckpt.formats.safetensors_backend.write_file_stream`). Target writers run in parallel (``workers``).
"""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, commit
from moeckpt.formats.errors import CheckpointIndexError, DataFileError, DestinationNotEmptyError, StorageError
from moeckpt.formats.index import FileEntry, Index
from moeckpt.formats.pieces import Piece, PieceRef, tensor_bytes, verify_blocks
from moeckpt.formats.storage import Storage, is_url

from .layout import Layout
from .placement import placements
from .planner import ReadItem, ReshardPlan, SourcePiece, TargetPiece, plan_reshard
from .processes import balanced_groups, can_fork, run_forked

# Offline defaults. 16 MB slabs with a 128 MB cache ran as fast as 64 MB / 384 MB with 300 MB less peak memory (1.1 GB
# benchmark state). Chunks are one checksum block: writers that need different rows of the same stored piece
# (ZeRO parts, expert ranges) then rarely share a chunk, whereas with 16 MB chunks a chunk evicted between two
# writers' visits was read again: zaya-small with AdamW state (5.5 GB) to tp=1 ep=4 dp=4 read 8.1-12.2 GB with
# 16 MB chunks and 6.1 GB with 4 MB ones, in the same time.
#: source pieces are read in row chunks of about this size (whole checksum blocks, so no block is read twice).
CHUNK_BYTES = 4 * 1024 * 1024
#: target pieces are assembled and written in row slabs of about this size.
SLAB_BYTES = 16 * 1024 * 1024
#: default byte budget of the chunk cache shared by all workers.
CACHE_BYTES = 128 * 1024 * 1024
#: a backend that stores pieces one by one (zarr) is handed a writer's pieces in batches of about this size.
WRITE_BATCH_BYTES = 64 * 1024 * 1024
#: each offline writer with read-ahead threads keeps the reads of its next pieces, up to about this many bytes, in
#: flight.
PREFETCH_BYTES = 16 * 1024 * 1024
#: a writer without read-ahead threads asks the kernel to read the source rows of its next pieces, up to about this
#: many bytes, ahead of it.
ADVISE_BYTES = 128 * 1024 * 1024


def _row_elems(box: Box) -> int:
    if not box.ndim or box.shape[0] == 0:
        return box.numel
    return box.numel // box.shape[0]


class ChunkReader:
    """Rows of stored source pieces, read in whole row chunks through a byte-bounded LRU cache.

    Several target boxes often need rows of the same stored piece (a TP split along dim 1 needs every row, a
    column range of each); the cache lets them share one read. Concurrent requests for the same chunk wait for
    the one read in flight. ``bytes_read`` counts the bytes fetched from storage, widened to checksum blocks.

    With ``clip``, a chunk is read only where it overlaps the request (its rows, widened to checksum blocks), for
    a reader whose requests rarely share chunks: one rank loading alone, whose ZeRO part of a piece may be a
    small slice of a chunk (reading whole chunks read 1.7-2.6x the bytes it needed at dp 4-8).
    """

    def __init__(
        self,
        reader: CheckpointReader | _RowFunctionReader,
        refs: Mapping[tuple[str, Box], PieceRef],
        *,
        chunk_bytes: int = CHUNK_BYTES,
        cache_bytes: int = CACHE_BYTES,
        read_threads: int = 0,
        clip: bool = False,
        map_files: bool = False,
    ):
        self.reader = reader
        self.clip = clip
        self.map_files = map_files
        self.refs = refs
        self.chunk_bytes = chunk_bytes
        self.cache_bytes = cache_bytes
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cached = 0
        self._local_safetensors = (
            isinstance(reader, CheckpointReader) and reader.index.backend == "safetensors" and reader.storage.is_local
        )
        #: the most bytes the cache kept at once (checked after each read's evictions).
        self.peak_cached = 0
        #: ``read_threads`` threads that read ahead of the consumers (:meth:`prefetch`), or None.
        self.pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(read_threads, thread_name_prefix="moeckpt-read") if read_threads else None
        )
        #: local files open for ``os.pread`` (thread-safe on one descriptor): opening a file for every 4 MB chunk
        #: cost a sixth of an offline reshard's samples.
        self._fds: dict[str, int] = {}

    def close(self) -> None:
        """Wait for the reads in flight, then close the local files this reader opened (in that order: a read
        racing a close could read a descriptor number the system has since given to another file)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fd(self, where: str) -> int:
        fd = self._fds.get(where)  # a dict lookup is atomic: only opening takes the lock
        if fd is None:
            fd = os.open(where, os.O_RDONLY)
            with self._lock:
                if where in self._fds:  # another thread opened it meanwhile
                    os.close(fd)
                    fd = self._fds[where]
                else:
                    self._fds[where] = fd
        return fd

    def _read_local(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a safetensors piece on local disk, read straight into an uninitialised tensor.

        The same bytes and checks as the backend's ``read_piece`` (whole checksum blocks, each verified), minus
        the zero-filled ``bytearray`` it reads into: at load time that memset was a quarter of the wall time.
        """
        a, b, b0, read_lo, read_hi = _block_span(ref, lo, hi)
        buf = torch.empty(read_hi - read_lo, dtype=torch.uint8)
        where = self.reader.storage.path(ref.file)
        try:
            got = os.preadv(self._fd(where), [memoryview(buf.numpy())], ref.start + read_lo) if len(buf) else 0
        except OSError as e:
            raise StorageError(f"{where}: reading tensor {ref.tensor!r} failed: {e}") from e
        if got != read_hi - read_lo:
            raise DataFileError(f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated")
        verify_blocks(memoryview(buf.numpy()), b0, ref, where)
        return buf[a - read_lo : b - read_lo].view(dtypes.to_torch(ref.dtype)).reshape((hi - lo,) + ref.box.shape[1:])

    def _map_local(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a safetensors piece on local disk, mapped from the page cache (``map_files``).

        Checked like :meth:`_read_local` (whole checksum blocks), but nothing is copied into this process: the
        checksums are computed over the mapped pages, and the caller copies what it needs straight from them. A
        private mapping, so nothing written through it reaches the file; its pages are unmapped when the last view
        of the chunk goes. Offline resharding only: a rank's state must not be backed by a file.
        """
        a, b, b0, read_lo, read_hi = _block_span(ref, lo, hi)
        where = self.reader.storage.path(ref.file)
        fd = self._fd(where)
        start = ref.start + read_lo
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(fd).st_size < ref.start + read_hi:  # mapping past the end would raise SIGBUS on access
                raise DataFileError(f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated")
            mapped = mmap.mmap(fd, start - base + read_hi - read_lo, offset=base, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise StorageError(f"{where}: reading tensor {ref.tensor!r} failed: {e}") from e
        verify_blocks(memoryview(mapped)[start - base :], b0, ref, where)
        shape = (hi - lo,) + ref.box.shape[1:]
        dtype = dtypes.to_torch(ref.dtype)
        if b == a:
            return torch.empty(shape, dtype=dtype)
        # Not a uint8 view: safetensors data need not sit at an offset aligned for its dtype (the header's length
        # is arbitrary), and torch refuses unaligned dtype views but reads an unaligned buffer fine.
        count = (b - a) // dtypes.itemsize(ref.dtype)
        return torch.frombuffer(mapped, dtype=dtype, offset=start - base + a - read_lo, count=count).reshape(shape)

    def ref(self, tensor: str, box: Box) -> PieceRef:
        try:
            return self.refs[(tensor, box)]
        except KeyError:
            raise CheckpointIndexError(
                f"{self.reader.location}: no stored piece of {tensor!r} with box {box.to_json()}, which the index "
                "implies; a data file is missing or does not match the index (run `moeckpt verify`)"
            ) from None

    def chunk_rows(self, ref: PieceRef) -> int:
        row = _row_elems(ref.box) * dtypes.itemsize(ref.dtype)
        rows = max(1, self.chunk_bytes // max(1, row))
        # Align chunks to checksum blocks when rows divide them, so neighbouring chunks never re-read a block.
        block = getattr(ref, "block_bytes", 0)
        if block and row and (rows * row) % block and block % row == 0:
            rows = max(block // row, rows - rows % (block // row))
        return rows

    def rows(self, tensor: str, box: Box, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` (piece coordinates) of the stored piece ``(tensor, box)``."""
        ref = self.ref(tensor, box)
        if not box.ndim:
            return self._chunk(ref, 0, 1)
        per = self.chunk_rows(ref)
        parts = []
        last = (r1 - 1) // per
        for c in range(r0 // per, last + 1):
            lo, hi = self._span(c, per, box.shape[0], r0, r1)
            if self.pool is not None and c < last:  # read the next chunk of this request while this one is used
                self._start(ref, *self._span(c + 1, per, box.shape[0], r0, r1), background=True)
            data = self._chunk(ref, lo, hi)
            parts.append(data[max(r0, lo) - lo : min(r1, hi) - lo])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _span(self, c: int, per: int, n: int, r0: int, r1: int) -> tuple[int, int]:
        """The rows chunk ``c`` reads for a request of rows ``[r0, r1)``: all of it, or with ``clip`` the overlap."""
        lo, hi = c * per, min((c + 1) * per, n)
        return (max(lo, r0), min(hi, r1)) if self.clip else (lo, hi)

    def prefetch(self, reads: Sequence[ReadItem], budget: int) -> None:
        """Start reading the first chunks ``reads`` will need, up to ``budget`` bytes: in the background pool, or
        without one, by asking the kernel to read them ahead (local safetensors files)."""
        if self.pool is None:
            if self._local_safetensors:
                self._advise(reads, budget)
            return
        for item in reads:
            ref = self.ref(item.tensor, item.src_box)
            if not ref.box.ndim or budget <= 0:
                continue
            per = self.chunk_rows(ref)
            r0, r1 = item.rows
            lo, hi = self._span(r0 // per, per, ref.box.shape[0], r0, r1)
            self._start(ref, lo, hi, background=True)
            budget -= (hi - lo) * (ref.nbytes // max(1, ref.box.shape[0]))

    def read_ahead(self, ref: PieceRef, lo: int, hi: int) -> None:
        """Start reading rows ``[lo, hi)`` of ``ref`` (one chunk) in the read-ahead pool; without one they are read
        when asked for."""
        if self.pool is not None:
            self._start(ref, lo, hi, background=True)

    def _advise(self, reads: Sequence[ReadItem], budget: int) -> None:
        """``posix_fadvise(WILLNEED)`` over the first rows of ``reads``: the kernel reads them while this thread
        works, which is what the read-ahead threads do for a reader that has them."""
        for item in reads:
            ref = self.ref(item.tensor, item.src_box)
            if budget <= 0:
                return
            if not ref.box.ndim or not ref.nbytes:
                continue
            row = ref.nbytes // ref.box.shape[0]
            n = min((item.rows[1] - item.rows[0]) * row, budget)
            where = self.reader.storage.path(ref.file)
            os.posix_fadvise(self._fd(where), ref.start + item.rows[0] * row, n, os.POSIX_FADV_WILLNEED)
            budget -= n

    def _chunk(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        return self._start(ref, lo, hi, background=False).result()

    def _start(self, ref: PieceRef, lo: int, hi: int, *, background: bool) -> Future:
        """The future of the rows ``[lo, hi)`` of ``ref``: cached, in flight, or started now (inline, or in the
        pool)."""
        key = (ref.file, ref.start, ref.tensor, lo, hi)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._cache[key] = Future()
        if background:
            self.pool.submit(self._read_into, fut, key, ref, lo, hi)
        else:
            self._read_into(fut, key, ref, lo, hi)
        return fut

    def _read_into(self, fut: Future, key: tuple, ref: PieceRef, lo: int, hi: int) -> None:
        try:
            if self._local_safetensors and ref.box.ndim and ref.nbytes:
                data = (self._map_local if self.map_files else self._read_local)(ref, lo, hi)
            else:
                data = self.reader.read_piece(ref, None if not ref.box.ndim else (lo, hi))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the chunk, and raised there
            with self._lock:
                self._cache.pop(key, None)
            fut.set_exception(e)
            return
        fut.set_result(data)
        nbytes = data.numel() * data.element_size()
        evicted = []  # freed after the lock is released: freeing a chunk unmaps it, a syscall every thread would wait on
        with self._lock:
            self.bytes_read += _widened(ref, lo, hi)
            self._cached += nbytes
            while self._cached > self.cache_bytes and len(self._cache) > 1:
                old_key, old = next(iter(self._cache.items()))
                if not old.done():
                    break
                del self._cache[old_key]
                if old.exception() is None:
                    t = old.result()
                    self._cached -= t.numel() * t.element_size()
                evicted.append(old)
            self.peak_cached = max(self.peak_cached, self._cached)
        del evicted


def _nbytes(piece: TargetPiece, index: Index) -> int:
    return piece.box.numel * dtypes.itemsize(index.tensors[piece.tensor].dtype)


def reads_started_ahead(
    pieces: Sequence[TargetPiece], index: Index, chunks: ChunkReader, window: int
) -> Iterator[tuple[int, TargetPiece]]:
    """``(position, piece)`` of ``pieces`` in order; before each, the reads of the pieces within ``window`` bytes
    ahead are started (:meth:`ChunkReader.prefetch`, each piece's once), so they are read while it is filled."""
    sizes = [_nbytes(p, index) for p in pieces]
    ahead = started = done = 0  # pieces[:ahead], of `started` bytes, have had their reads started
    for pos, piece in enumerate(pieces):
        while ahead < len(pieces) and started - done < window:
            chunks.prefetch(pieces[ahead].reads, sizes[ahead])
            started += sizes[ahead]
            ahead += 1
        done += sizes[pos]
        yield pos, piece


def _block_span(ref: PieceRef, lo: int, hi: int) -> tuple[int, int, int, int, int]:
    """Rows ``[lo, hi)`` of a stored piece as bytes ``[a, b)`` of its data, and the whole checksum blocks around
    them: the first block's number and bytes ``[read_lo, read_hi)`` (what a verified read fetches)."""
    row = ref.nbytes // ref.box.shape[0] if ref.box.shape[0] else 0
    a, b = lo * row, hi * row
    block = ref.block_bytes
    b0 = a // block
    return a, b, b0, b0 * block, min(-(-b // block) * block if b else block, ref.nbytes)


def _widened(ref: PieceRef, lo: int, hi: int) -> int:
    """Bytes a row read fetches: whole checksum blocks around the rows (how every backend verifies reads)."""
    if not ref.box.ndim or not ref.box.shape[0]:
        return ref.nbytes
    if not ref.block_bytes:  # rows a function produces (write_rows): no blocks, exactly the rows
        return (hi - lo) * (ref.nbytes // ref.box.shape[0])
    _, _, _, read_lo, read_hi = _block_span(ref, lo, hi)
    return read_hi - read_lo


def fill(out: torch.Tensor, out_box: Box, reads: Sequence[ReadItem], chunks: ChunkReader) -> int:
    """Copy into ``out`` (holding ``out_box``) every part of ``reads`` that falls in it; returns elements copied."""
    copied = 0
    for item in reads:
        sub = item.region.intersect(out_box) if out_box.ndim else item.region
        if sub is None:
            continue
        rel = sub.relative_to(item.src_box)
        if out_box.ndim:
            r0 = rel.offsets[0]
            data = chunks.rows(item.tensor, item.src_box, r0, r0 + rel.shape[0])
            out[sub.relative_to(out_box).slices()] = data[(slice(None),) + rel.slices()[1:]]
        else:
            out.copy_(chunks.rows(item.tensor, item.src_box, 0, 1))
        copied += sub.numel
    return copied


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
    direct = _direct_read(piece)
    if direct is not None:
        src = direct.src_box
        per = chunks.chunk_rows(chunks.ref(direct.tensor, src))
        r0, r1 = direct.rows
        lo = r0
        while lo < r1:
            hi = min(r1, (lo // per + 1) * per)  # stay inside one source chunk: a view, not a concatenation
            yield chunks.rows(direct.tensor, src, lo, hi)
            lo = hi
        return
    row = _row_elems(box) * dtypes.itemsize(dtype)
    per = max(1, slab_bytes // max(1, row))
    for lo in range(0, box.shape[0], per):
        n = min(per, box.shape[0] - lo)
        sbox = Box((box.offsets[0] + lo,) + box.offsets[1:], (n,) + box.shape[1:])
        out = _buffer(sbox.numel * dtypes.itemsize(dtype)).view(torch_dtype).reshape(sbox.shape) if reuse else (
            torch.empty(sbox.shape, dtype=torch_dtype)
        )
        if fill(out, sbox, piece.reads, chunks) != sbox.numel:
            raise CheckpointIndexError(f"tensor {piece.tensor!r}: reads do not fill box {sbox.to_json()}")
        yield out


def _direct_read(piece: TargetPiece) -> ReadItem | None:
    """The single read that is the whole piece at the full width of its stored piece, if there is one."""
    if len(piece.reads) != 1:
        return None
    r = piece.reads[0]
    src, box = r.src_box, piece.box
    if r.region != box or src.offsets[1:] != box.offsets[1:] or src.shape[1:] != box.shape[1:]:
        return None
    return r


_local = threading.local()


def _buffer(nbytes: int) -> torch.Tensor:
    """A per-thread byte buffer of at least ``nbytes``, reused across slabs."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buf[:nbytes]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector off for the duration (restored afterwards).

    Planning and reading a checkpoint allocate some 100,000 small objects (boxes, read items, tuples), which
    trigger full collections, and each full collection walks every object of the process: with torch imported,
    0.1-0.3 s each. A 4-rank load of a 1.1 GB state spent 0.4-0.6 s per rank in them, a fifth of its time.
    The objects are freed by reference counting; cycles made meanwhile are collected after.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one intra-op thread each for the duration (restored afterwards).

    The executor parallelises over pieces with its own workers; letting every copy also fan out over torch's
    thread pool oversubscribes the cores, and strided copies then crawl (measured 0.2 GB/s instead of 20+).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class ReshardResult:
    """What an offline reshard did."""

    index: Index
    plan: ReshardPlan
    #: bytes fetched from the source storage (data, widened to checksum blocks; headers not included).
    bytes_read: int
    #: logical bytes written (the new checkpoint's pieces).
    bytes_written: int
    seconds: float


def reshard(
    src: str,
    dst: str,
    target: Layout,
    *,
    backend: str | None = None,
    workers: int = 4,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    slab_bytes: int = SLAB_BYTES,
    cache_bytes: int = CACHE_BYTES,
) -> ReshardResult:
    """Write the checkpoint at ``src`` (or a run's newest step) to ``dst`` in layout ``target``.

    The new checkpoint has the same step, train state and model, the new layout, new files and checksums, in
    format ``backend`` (default: the source's). ``on_bytes`` is called with the bytes of each slab written.
    """
    started = time.perf_counter()
    with paused_gc():  # the index's and headers' parse make many objects too: see paused_gc
        reader = CheckpointReader(src)
        index = reader.index
        _refuse_overlap(reader.location, Storage(dst).location)
        new_index, plan, bytes_read = _convert(
            reader, reader.pieces(), index, dst, target, backend=backend or index.backend, workers=workers,
            overwrite=overwrite, on_bytes=on_bytes, chunk_bytes=chunk_bytes, slab_bytes=slab_bytes,
            cache_bytes=cache_bytes,
        )
    # The writers checked that every byte of the state was written exactly once (_Writers._check).
    return ReshardResult(new_index, plan, bytes_read, index.nbytes, time.perf_counter() - started)


def _refuse_overlap(src: str, dst: str) -> None:
    """Refuse a destination that is the source checkpoint, lies inside it, or holds it (a run directory whose
    step is being resharded): writing there, with ``--overwrite`` or not, would destroy the source."""
    def norm(loc: str) -> str:
        loc = loc.rstrip("/")
        return loc if is_url(loc) else os.path.realpath(loc)

    a, b = norm(src), norm(dst)
    if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
        where = "is" if a == b else ("holds" if a.startswith(b + "/") else "is inside")
        raise DestinationNotEmptyError(
            f"{dst}: destination {where} the source checkpoint {src}; write the resharded checkpoint elsewhere"
        )


RowReader = Callable[[str, int, int], torch.Tensor]


class _RowFunctionReader:
    """The part of :class:`CheckpointReader` a :class:`ChunkReader` uses, over a function that yields rows."""

    def __init__(self, index: Index, read_rows: RowReader, location: str):
        self.index = index
        self.location = location
        self._read_rows = read_rows

    def read_piece(self, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        lo, hi = rows if rows is not None else (0, 1)
        return self._read_rows(ref.tensor, lo, hi)


def write_rows(
    dst: str,
    index: Index,
    target: Layout,
    read_rows: RowReader,
    *,
    source_name: str,
    workers: int = 4,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    slab_bytes: int = SLAB_BYTES,
    cache_bytes: int = CACHE_BYTES,
) -> Index:
    """Write the logical tensors of ``index`` to ``dst`` in layout ``target``, each produced by row ranges.

    ``read_rows(name, r0, r1)`` returns rows ``[r0, r1)`` of the whole logical tensor ``name`` (dim 0; a 0-d
    tensor is asked for rows ``[0, 1)`` and returned as is), in the entry's shape and dtype. Rows are asked for in
    chunks of about ``chunk_bytes`` through the same bounded cache as :func:`reshard`, so memory is set by a few
    chunks, never by the model: this is how a Hugging Face model becomes a checkpoint in any layout. The format is
    ``index.backend``; ``index.files`` is ignored. ``source_name`` names the source in error messages.
    """
    refs = []  # one whole-tensor piece per logical tensor, whose rows read_rows produces
    for name, entry in index.tensors.items():
        box = Box((0,) * len(entry.shape), tuple(entry.shape))
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        refs.append(PieceRef(name, box, entry.dtype, source_name, 0, nbytes, (), block_bytes=0))
    reader = _RowFunctionReader(index, read_rows, source_name)
    new_index, _plan, _read = _convert(
        reader, refs, index, dst, target, backend=index.backend, workers=workers, overwrite=overwrite,
        on_bytes=on_bytes, chunk_bytes=chunk_bytes, slab_bytes=slab_bytes, cache_bytes=cache_bytes,
    )
    return new_index


def _convert(reader, refs, index, dst, target, *, backend, workers, overwrite, on_bytes, chunk_bytes,
             slab_bytes, cache_bytes) -> tuple[Index, ReshardPlan, int]:
    """Plan ``index``'s tensors, stored as the pieces ``refs``, into ``target`` and write them to ``dst``; commit."""
    out_backend = get_backend(backend)  # fails early on an unknown format
    sources: dict[str, list[SourcePiece]] = {name: [] for name in index.tensors}
    for ref in refs:
        sources[ref.tensor].append(SourcePiece(ref.tensor, ref.box, -1))
    plan = plan_reshard(index, target, sources=sources)
    by_key = {(ref.tensor, ref.box): ref for ref in refs}

    def open_chunks(read_threads: int, cache: int) -> ChunkReader:
        return ChunkReader(reader, by_key, chunk_bytes=chunk_bytes, cache_bytes=cache, read_threads=read_threads,
                           map_files=True)

    new_index = replace(index, backend=backend, layout=target.to_json(), files={})
    storage = begin_save(dst, overwrite=overwrite)
    writers = _Writers(index, plan, storage, out_backend, backend, target, slab_bytes)
    try:
        with single_threaded_torch(), paused_gc():
            if workers > 1 and len(plan.ranks) > 1 and _forkable(reader, storage, backend):
                entries, bytes_read = writers.in_processes(open_chunks, workers, cache_bytes, on_bytes)
            else:
                entries, bytes_read = writers.in_threads(open_chunks, workers, cache_bytes, on_bytes)
        new_index = replace(new_index, files={e.path: e for e in out_backend.finish(storage, entries, index.tensors)})
    except BaseException:
        # Leave nothing behind that looks like a save in progress: the staging data of a failed write goes.
        if storage.is_local:
            storage.remove()
        raise
    commit(dst, new_index)
    return new_index, plan, bytes_read


def _forkable(reader, storage: Storage, backend: str) -> bool:
    """Whether the writers can run in forked processes: local safetensors in and out, on Linux.

    Only there: zarr and fsspec (S3) keep event-loop threads that a forked child would inherit dead, and an S3
    reshard waits on the network, not on the interpreter lock.
    """
    return (
        can_fork()
        and isinstance(reader, CheckpointReader)
        and reader.index.backend == "safetensors"
        and reader.storage.is_local
        and backend == "safetensors"
        and storage.is_local
    )


class _Writers:
    """Writes every target writer's file of an offline plan, in threads or in forked processes."""

    def __init__(self, index, plan, storage, out_backend, fmt, target, slab_bytes):
        self.index, self.plan, self.storage = index, plan, storage
        self.out_backend, self.fmt, self.slab_bytes = out_backend, fmt, slab_bytes
        out_backend.prepare(
            storage,
            index.tensors,
            {name: [p.box for p in placements(e, target) if not p.box.is_empty()] for name, e in index.tensors.items()},
        )

    def in_threads(self, open_chunks, workers, cache_bytes, on_bytes) -> tuple[list[FileEntry], int]:
        """``workers`` writer threads sharing one chunk cache and ``workers`` read-ahead threads."""
        written = [0]
        lock = threading.Lock()

        def count(n: int) -> None:
            with lock:
                written[0] += n
            if on_bytes is not None:
                on_bytes(n)

        with open_chunks(max(1, workers), cache_bytes) as chunks, ThreadPoolExecutor(max(1, workers)) as pool:
            entries = [e for es in pool.map(lambda rp: self.write(rp, chunks, count), self.plan.ranks) for e in es]
        self._check(written[0])
        return entries, chunks.bytes_read

    def in_processes(self, open_chunks, workers, cache_bytes, on_bytes) -> tuple[list[FileEntry], int]:
        """Target writers spread over ``workers`` forked processes (balanced by bytes), each one thread reading
        with kernel read-ahead, with a share of the cache budget."""
        groups = balanced_groups(self.plan.ranks, [rp.nbytes for rp in self.plan.ranks], workers)

        def job(group, report) -> dict:
            written = [0]

            def count(n: int) -> None:
                written[0] += n
                report(n)

            with open_chunks(0, cache_bytes // len(groups)) as chunks:
                files = [e for rp in group for e in self.write(rp, chunks, count)]
            return {"files": [[e.path, e.size, e.checksum] for e in files], "read": chunks.bytes_read,
                    "written": written[0]}

        done = run_forked(groups, job, on_bytes)
        self._check(sum(d["written"] for d in done))
        files = [FileEntry(path=p, size=n, checksum=c) for d in done for p, n, c in d["files"]]
        return files, sum(d["read"] for d in done)

    def _check(self, written: int) -> None:
        if written != self.index.nbytes:
            raise CheckpointIndexError(f"reshard wrote {written} bytes of {self.index.nbytes}: the plan is incomplete")

    def write(self, rank_plan, chunks: ChunkReader, count: Callable[[int], None]) -> list[FileEntry]:
        """Write one target writer's pieces; returns its file entries."""
        index, storage, out_backend, slab_bytes = self.index, self.storage, self.out_backend, self.slab_bytes
        pieces = rank_plan.pieces
        if self.fmt == "safetensors":
            from moeckpt.formats import safetensors_backend as st

            def stream():
                # Read-ahead by the kernel goes to the page cache, not this process's memory: a wider window.
                window = PREFETCH_BYTES if chunks.pool is not None else ADVISE_BYTES
                for pos, piece in reads_started_ahead(pieces, index, chunks, window):
                    for slab in slabs(piece, index.tensors[piece.tensor].dtype, chunks, slab_bytes, reuse=True):
                        data = tensor_bytes(slab)
                        yield pos, data
                        count(len(data))

            layout = [(p.tensor, p.box) for p in pieces]
            return [st.write_file_stream(storage, st.file_name(rank_plan.rank), layout, index.tensors, stream())]
        # Other backends take pieces in batches when they store each piece on its own (zarr: one object per grid
        # cell), so memory is a batch and the piece being assembled; otherwise a writer's pieces whole.
        piecewise = out_backend.piecewise_writes
        entries, batch, held = [], [], 0
        for piece in pieces:
            entry = index.tensors[piece.tensor]
            parts = list(slabs(piece, entry.dtype, chunks, slab_bytes))
            data = parts[0] if len(parts) == 1 else torch.cat(parts)
            del parts
            batch.append(Piece(piece.tensor, piece.box, data))
            held += data.numel() * data.element_size()
            count(data.numel() * data.element_size())
            if piecewise and held >= WRITE_BATCH_BYTES:
                entries += out_backend.write(storage, rank_plan.rank, batch, index.tensors)
                batch, held = [], 0
        if batch or not entries:
            entries += out_backend.write(storage, rank_plan.rank, batch, index.tensors)
        return entries
