"""The chunk cache: rows of stored source pieces, read in whole row chunks through a byte-bounded LRU cache.

Both the offline run and a load read source pieces through a :class:`ChunkReader`. It reads through the source
backend's :class:`~moeckpt.formats.backend.PieceReader` (row reads verified against the checksums; mapped rows
offline, where the backend and storage can map), and never touches files itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import PieceReader
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES, PieceRef, fetched_bytes

from .options import OFFLINE_CACHE_BYTES, OFFLINE_CHUNK_BYTES
from .plan import ReadItem, TargetPiece

#: chunks of pieces whose rows do not divide the checksum blocks span at least this many blocks.
MISALIGNED_CHUNK_BLOCKS = 8


def chunk_rows(box: Box, dtype: str, chunk_bytes: int, block_bytes: int = CHECKSUM_BLOCK_BYTES) -> int:
    """Rows per read chunk of a stored piece of ``box``: about ``chunk_bytes``, aligned to checksum blocks of
    ``block_bytes`` when rows divide them, so neighbouring chunks never read a block twice (``0``: no blocks).

    The grid every reader of the piece shares: the chunk cache reads on it, and a collective load divides the
    reads between ranks on it.
    """
    if not box.ndim or not box.shape[0]:
        return 1
    row = box.numel // box.shape[0] * dtypes.itemsize(dtype)
    rows = max(1, chunk_bytes // max(1, row))
    if block_bytes and row and (rows * row) % block_bytes and block_bytes % row == 0:
        rows = max(block_bytes // row, rows - rows % (block_bytes // row))
    elif block_bytes and row and block_bytes % row and row % block_bytes:
        # Rows that do not divide the blocks: neighbouring chunks both fetch the block they straddle. Chunks of
        # MISALIGNED_CHUNK_BLOCKS blocks or more (a piece up to that size in one chunk) keep that to a fraction.
        rows = max(rows, -(-MISALIGNED_CHUNK_BLOCKS * block_bytes // row))
    return rows


def grid_spans(r0: int, r1: int, per: int) -> Iterator[tuple[int, int]]:
    """Rows ``[r0, r1)`` cut at the chunk grid of ``per`` rows: each ``(lo, hi)`` inside one chunk."""
    lo = r0
    while lo < r1:
        hi = min(r1, (lo // per + 1) * per)
        yield lo, hi
        lo = hi


class ChunkReader:
    """Rows of stored source pieces, read in whole row chunks through a byte-bounded LRU cache.

    Several target boxes often need rows of the same stored piece (a TP split along dim 1 needs every row, a
    column range of each); the cache lets them share one read. Concurrent requests for the same chunk wait for
    the one read in flight. ``bytes_read`` counts the bytes fetched from storage, widened to checksum blocks.

    Offline, :meth:`expect` counts every planned use of each chunk; a chunk then stays cached until its last
    planned reader took its rows (:meth:`rows` with ``until``) and goes at once after, whatever the LRU order,
    so writers that share stored pieces and run together (:meth:`consumer`) read each stored byte once. Memory
    stays bounded: a reader about to read a new chunk while the cache is over budget waits for the others to
    take the chunks it took and they still need (unless every other reader waits too), and past twice the budget plus two of the
    largest chunks per reader, pinned chunks are evicted anyway (read again later, and counted).

    ``source`` is a checkpoint (its backend's read session is opened here and closed by :meth:`close`) or a
    read session (the caller closes it). With ``clip``, a chunk is read only where it overlaps the request (its
    rows, widened to checksum blocks), for a reader whose requests rarely share chunks: one rank loading alone,
    whose ZeRO part of a piece may be a small slice of a chunk. With ``map_files``, chunks are mapped rather than
    copied where the session can map (offline only).
    """

    def __init__(
        self,
        source: CheckpointReader | PieceReader,
        refs: Mapping[tuple[str, Box], PieceRef],
        *,
        chunk_bytes: int = OFFLINE_CHUNK_BYTES,
        cache_bytes: int = OFFLINE_CACHE_BYTES,
        read_threads: int = 0,
        clip: bool = False,
        map_files: bool = False,
    ):
        #: the read session; opened here (and closed by :meth:`close`) for a checkpoint, else the caller's.
        self.pieces: PieceReader = source.open_reader() if isinstance(source, CheckpointReader) else source
        self._owns_pieces = isinstance(source, CheckpointReader)
        self.location = source.location
        self.clip = clip
        self.map_files = map_files
        self.refs = refs
        self.chunk_bytes = chunk_bytes
        self.cache_bytes = cache_bytes
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._cached = 0
        #: the most bytes the cache kept at once (checked after each read's evictions).
        self.peak_cached = 0
        #: planned uses still to come per chunk key (:meth:`expect`); empty when uses are not tracked.
        self._uses: dict[tuple, int] = {}
        #: of those, per chunk key, the uses of each named reader (``expect(..., reader=)``).
        self._uses_by: dict[tuple, dict[object, int]] = {}
        self._reader = threading.local()  # the name :meth:`consumer` gave the calling thread
        self._freed = threading.Condition(self._lock)
        self._consumers = self._waiting = 0
        #: the named readers running as consumers now, with how many threads each (:meth:`consumer`).
        self._running: dict[object, int] = {}
        #: per reader, the chunks it took that other readers still need; per chunk, those readers.
        self._ahead: dict[object, int] = {}
        self._ahead_of: dict[tuple, list[object]] = {}
        self._largest = 0  # bytes of the largest chunk read so far
        self._inflight = 0  # bytes of the reads started and not finished
        #: ``read_threads`` threads that read ahead of the consumers (:meth:`prefetch`), or None.
        self.pool: ThreadPoolExecutor | None = (
            ThreadPoolExecutor(read_threads, thread_name_prefix="moeckpt-read") if read_threads else None
        )

    def close(self) -> None:
        """Wait for the reads in flight, then close the read session (in that order: a read racing a close could
        read a descriptor number the system has since given to another file)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if self._owns_pieces:
            self.pieces.close()

    def __enter__(self) -> ChunkReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ref(self, tensor: str, box: Box) -> PieceRef:
        try:
            return self.refs[(tensor, box)]
        except KeyError:
            raise CheckpointIndexError(
                f"{self.location}: no stored piece of {tensor!r} with box {box.to_json()}, which the index "
                "implies; a data file is missing or does not match the index (run `moeckpt verify`)"
            ) from None

    def chunk_rows(self, ref: PieceRef) -> int:
        """Rows per chunk of the stored piece ``ref`` (:func:`chunk_rows` on its own checksum blocks)."""
        return chunk_rows(ref.box, ref.dtype, self.chunk_bytes, ref.unit_bytes)

    def rows(self, tensor: str, box: Box, r0: int, r1: int, *, until: int | None = None) -> torch.Tensor:
        """Rows ``[r0, r1)`` (piece coordinates) of the stored piece ``(tensor, box)``.

        ``until``: the end of the planned read these rows belong to (``ReadItem.rows[1]``), which asks for its
        rows in increasing order; the use :meth:`expect` counted for a chunk ends with the request that reaches
        the last row the read needs of it."""
        parts = [data for _, data in self.row_parts(tensor, box, r0, r1, until=until)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def row_parts(
        self, tensor: str, box: Box, r0: int, r1: int, *, until: int | None = None
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Rows ``[r0, r1)`` of the stored piece ``(tensor, box)`` as :meth:`rows` gives them, but chunk by chunk:
        ``(first row, rows)`` views of the chunks, each consumed before the next is asked for. A caller copying the
        rows into place copies each view there, instead of the concatenation :meth:`rows` makes of rows spanning
        several chunks: a fresh tensor (its pages faulted in) and a second copy of every byte. (A 0-d piece
        gives ``(0, the value)``.)"""
        ref = self.ref(tensor, box)
        if not box.ndim:
            data = self._chunk(ref, 0, 1)
            if until is not None:
                self._used(_key(ref, 0, 1))
            yield 0, data
            return
        per = self.chunk_rows(ref)
        last = (r1 - 1) // per
        for c in range(r0 // per, last + 1):
            lo, hi = self._span(c, per, box.shape[0], r0, r1)
            if self.pool is not None and c < last:  # read the next chunk of this request while this one is used
                self._start(ref, *self._span(c + 1, per, box.shape[0], r0, r1), background=True)
            data = self._chunk(ref, lo, hi)
            first = max(r0, lo)
            view = data[first - lo : min(r1, hi) - lo]
            if until is not None and r0 < min(hi, until) <= r1:
                self._used(_key(ref, lo, hi))
            yield first, view

    def copy_region(self, tensor: str, box: Box, region: Box, out: torch.Tensor, *, until: int | None = None) -> None:
        """``region`` (in piece coordinates) of the stored piece ``(tensor, box)`` copied into ``out`` (a tensor of
        its shape, any strides: a view of where it lands), chunk by chunk from :meth:`row_parts` (``until`` as
        there), with no concatenation of the rows first."""
        if not box.ndim:
            out.copy_(self.rows(tensor, box, 0, 1, until=until))
            return
        r0, cols = region.offsets[0], (slice(None),) + region.slices()[1:]
        for first, data in self.row_parts(tensor, box, r0, r0 + region.shape[0], until=until):
            out[first - r0 : first - r0 + data.shape[0]] = data[cols]

    def expect(self, pieces: Iterable[TargetPiece], *, reader: object = None) -> None:
        """Count the planned uses of the chunks ``pieces`` read (whole chunks: not with ``clip``), as the uses of
        ``reader`` where named (the name its thread gives :meth:`consumer`)."""
        with self._lock:
            for piece in pieces:
                for item in piece.reads:
                    ref = self.ref(item.tensor, item.src_box)
                    for key in chunk_keys(ref, item.rows, self.chunk_rows(ref)):
                        self._uses[key] = self._uses.get(key, 0) + 1
                        if reader is not None:
                            mine = self._uses_by.setdefault(key, {})
                            mine[reader] = mine.get(reader, 0) + 1

    @contextmanager
    def consumer(self, reader: object = None) -> Iterator[None]:
        """Mark the calling thread as a reader while the block runs (see the class: who waits for whom), as the
        reader ``reader`` names in :meth:`expect` where given."""
        with self._lock:
            self._consumers += 1
            if reader is not None:
                self._running[reader] = self._running.get(reader, 0) + 1
        self._reader.name = reader
        try:
            yield
        finally:
            self._reader.name = None
            with self._lock:
                self._consumers -= 1
                if reader is not None:
                    self._running[reader] -= 1
                    if not self._running[reader]:
                        del self._running[reader]
                self._freed.notify_all()

    def _me(self) -> object:
        """The calling reader: the name :meth:`consumer` gave its thread, else the thread."""
        name = getattr(self._reader, "name", None)
        return name if name is not None else threading.get_ident()

    def _others_left(self, key: tuple, reader: object) -> int:
        """Planned uses of chunk ``key`` still to come by readers other than ``reader`` that can take it now: the
        unnamed uses, and those of named readers running as consumers (caller holds the lock). A named reader not
        started yet (a writer of a long group waiting for a thread) is nobody to wait for: a reader ahead of it
        would hold back until every running reader waits too, each time the cache is full; its chunks stay
        pinned meanwhile, within the hard cap."""
        by = self._uses_by.get(key)
        if not by:
            return self._uses.get(key, 0)
        unnamed = self._uses.get(key, 0) - sum(by.values())
        return unnamed + sum(n for r, n in by.items() if r != reader and r in self._running)

    def _behind(self, reader: object) -> int:
        """Chunks other readers took that ``reader`` still needs (caller holds the lock). A reader sharing chunks
        with two others (the middle of a chain of ZeRO re-splits) is ahead of one and behind the other: had it
        waited for being ahead at all, the readers behind it waited on it in turn, one reader read on alone, and
        the cache grew past its hard cap (chunks read twice). It waits while it is ahead by at least as many
        chunks as it is behind (two readers even on both counts: one of them waits, as before)."""
        n = 0
        for key, ahead in self._ahead_of.items():
            if ahead and reader not in ahead and self._uses_by.get(key, {}).get(reader, 0) > 0:
                n += 1
        return n

    def _used(self, key: tuple) -> None:
        """One planned use of chunk ``key`` is over; after the last, the chunk leaves the cache."""
        with self._lock:
            left = self._uses.get(key)
            if left is None:
                return
            me = self._me()
            mine = self._uses_by.get(key)
            if mine is not None and mine.get(me):
                mine[me] -= 1
            if left > 1:
                self._uses[key] = left - 1
                # A reader is ahead of the others on this chunk while they still need it; not where the uses
                # left are its own (two reads of one chunk, the gate and up halves of a fused tensor): waiting
                # for others to take a chunk only it needs would hold it back for nothing.
                ahead = self._ahead_of.setdefault(key, [])
                if me not in ahead and self._others_left(key, me):
                    ahead.append(me)
                    self._ahead[me] = self._ahead.get(me, 0) + 1
                for reader in [r for r in ahead if not self._others_left(key, r)]:
                    ahead.remove(reader)  # the others have caught up with it on this chunk
                    self._ahead[reader] -= 1
                self._freed.notify_all()
                return
            del self._uses[key]
            self._uses_by.pop(key, None)
            for reader in self._ahead_of.pop(key, ()):
                self._ahead[reader] -= 1
            self._freed.notify_all()
            fut = self._cache.get(key)
            if fut is None or not fut.done():
                return
            del self._cache[key]
            self._cached -= _size(fut)

    def _span(self, c: int, per: int, n: int, r0: int, r1: int) -> tuple[int, int]:
        """The rows chunk ``c`` reads for a request of rows ``[r0, r1)``: all of it, or with ``clip`` the overlap."""
        lo, hi = c * per, min((c + 1) * per, n)
        return (max(lo, r0), min(hi, r1)) if self.clip else (lo, hi)

    def prefetch(self, reads: Sequence[ReadItem], budget: int) -> None:
        """Start reading the first chunks ``reads`` will need, up to ``budget`` bytes: in the background pool, or
        without one, by asking the storage to read them ahead (the kernel's read-ahead on local disk)."""
        if self.pool is None:
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
        """Read-ahead hints over the first rows of ``reads``: the kernel reads them while this thread works, which
        is what the read-ahead threads do for a reader that has them."""
        for item in reads:
            if budget <= 0:
                return
            ref = self.ref(item.tensor, item.src_box)
            if not ref.box.ndim or not ref.nbytes:
                continue
            row = ref.nbytes // ref.box.shape[0]
            r0, r1 = item.rows
            n = min(r1 - r0, -(-budget // max(1, row)))
            self.pieces.advise(ref, r0, r0 + n)
            budget -= n * row

    def _chunk(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        return self._start(ref, lo, hi, background=False).result()

    def _start(self, ref: PieceRef, lo: int, hi: int, *, background: bool) -> Future:
        """The future of the rows ``[lo, hi)`` of ``ref``: cached, in flight, or started now (inline, or in the
        pool). With planned uses and the cache over budget, a read ahead is not started (an empty future), and a
        reader ahead of others (it took chunks they still need) waits before a new read until they caught up,
        unless every other reader waits too: the reader behind never waits, so they always move."""
        key = _key(ref, lo, hi)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            if self._uses and self._cached + self._inflight >= self.cache_bytes:
                if background:
                    return Future()
                me = self._me()
                while (
                    self._cached >= self.cache_bytes
                    and 0 < self._ahead.get(me, 0) >= self._behind(me)
                    and self._waiting + 1 < self._consumers
                ):
                    self._waiting += 1
                    self._freed.notify_all()  # a reader that waits may let another one go (see the loop's test)
                    self._freed.wait(1.0)
                    self._waiting -= 1
                fut = self._cache.get(key)
                if fut is not None:  # another reader started it meanwhile
                    self._cache.move_to_end(key)
                    return fut
            fut = self._cache[key] = Future()
            self._inflight += fetched_bytes(ref, lo, hi)
        if background and self.pool is not None:
            self.pool.submit(self._read_into, fut, key, ref, lo, hi)
        else:
            self._read_into(fut, key, ref, lo, hi)
        return fut

    def _read_into(self, fut: Future, key: tuple, ref: PieceRef, lo: int, hi: int) -> None:
        try:
            data = self.pieces.map_rows(ref, lo, hi) if self.map_files else None
            if data is None:
                data = self.pieces.read_rows(ref, lo, hi)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the chunk, and raised there
            with self._lock:
                self._inflight -= fetched_bytes(ref, lo, hi)
                self._cache.pop(key, None)
            fut.set_exception(e)
            return
        fut.set_result(data)
        nbytes = data.numel() * data.element_size()
        evicted = []  # freed after the lock is released: freeing a chunk unmaps it, a syscall every thread would wait on
        with self._lock:
            self.bytes_read += fetched_bytes(ref, lo, hi)
            self._inflight -= fetched_bytes(ref, lo, hi)
            self._cached += nbytes
            self._largest = max(self._largest, nbytes)
            while self._cached > self.cache_bytes and len(self._cache) > 1:
                old_key = self._victim(key)
                if old_key is None:
                    break
                old = self._cache.pop(old_key)
                self._cached -= _size(old)
                evicted.append(old)
            self.peak_cached = max(self.peak_cached, self._cached)
            self._freed.notify_all()
        del evicted

    def _victim(self, just_read: tuple) -> tuple | None:
        """The chunk to evict (caller holds the lock): the least recently used one read and not pinned by a
        planned use; past twice the budget, the least recently used one read. None: nothing can go."""
        pinned = None
        for key, fut in self._cache.items():
            if not fut.done() or key == just_read:
                continue
            if key not in self._uses:
                return key
            if pinned is None:
                pinned = key
        # Pinned chunks wait for readers that make progress (see _start); only a working set far beyond the
        # budget and what each reader can hold at once (a chunk being read, one being used) gives them up.
        hard_cap = 2 * self.cache_bytes + 2 * (self._consumers + 1) * self._largest
        return pinned if self._cached > hard_cap else None


def _key(ref: PieceRef, lo: int, hi: int) -> tuple:
    return (ref.file, ref.start, ref.tensor, lo, hi)


def _size(fut: Future) -> int:
    """Bytes a finished chunk future holds (0 for a failed read)."""
    if fut.exception() is not None:
        return 0
    t = fut.result()
    return t.numel() * t.element_size()


def chunk_keys(ref: PieceRef, rows: tuple[int, int], per: int) -> list[tuple]:
    """The cache keys of the whole chunks (``per`` rows each) that rows ``[r0, r1)`` of ``ref`` touch."""
    if not ref.box.ndim:
        return [_key(ref, 0, 1)]
    r0, r1 = rows
    n = ref.box.shape[0]
    return [_key(ref, c * per, min((c + 1) * per, n)) for c in range(r0 // per, (r1 - 1) // per + 1)] if r1 > r0 else []


def reads_started_ahead(
    pieces: Sequence[TargetPiece], index: Index, chunks: ChunkReader, window: int
) -> Iterator[tuple[int, TargetPiece]]:
    """``(position, piece)`` of ``pieces`` in order; before each, the reads of the pieces within ``window`` bytes
    ahead are started (:meth:`ChunkReader.prefetch`, each piece's once), so they are read while it is filled."""
    sizes = [p.box.numel * dtypes.itemsize(index.tensors[p.tensor].dtype) for p in pieces]
    ahead = started = done = 0  # pieces[:ahead], of `started` bytes, have had their reads started
    for pos, piece in enumerate(pieces):
        while ahead < len(pieces) and started - done < window:
            chunks.prefetch(pieces[ahead].reads, sizes[ahead])
            started += sizes[ahead]
            ahead += 1
        done += sizes[pos]
        yield pos, piece
