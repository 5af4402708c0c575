"""The offline run: a checkpoint (or tensors produced by rows) written into a new layout, with bounded memory.

Memory stays bounded by a few pieces, never by the checkpoint: target pieces are assembled and written in row
slabs (:mod:`.slabs`), source pieces are read in row chunks through a cache with a byte budget (:mod:`.chunks`),
and each target writer's pieces go to its backend's streamed write. Target writers run in parallel
(``ReshardOptions.workers``): in forked processes where the source and target backends and storages survive a
fork (:mod:`.processes`), else in threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import Backend, PieceReader, backend_compressions, get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, commit, discard
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import CheckpointIndexError, DestinationNotEmptyError, LayoutError
from moeckpt.formats.index import FileEntry, Index
from moeckpt.formats.pieces import PieceRef, fetched_bytes
from moeckpt.formats.storage import Storage, is_url
from moeckpt.formats.storages import open_storage

from .chunks import ChunkReader, chunk_keys, chunk_rows, reads_started_ahead
from .layout import Layout
from .options import ReshardOptions
from .plan import RankPlan, ReshardPlan, SourcePiece
from .planner import plan_reshard
from .processes import balanced_groups, can_fork, run_forked
from .runtime import paused_gc, single_threaded_torch
from .sharing import GROUP_THREADS, sharing_groups
from .slabs import slabs
from .state_dict_checkpoints import WriterMesh, is_state_dict, sharded_over_writers

log = logging.getLogger(__name__)


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
    compress: str | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    options: ReshardOptions | None = None,
    mesh: WriterMesh | None = None,
) -> ReshardResult:
    """Write the checkpoint at ``src`` (or a run's newest step) to ``dst`` in layout ``target``.

    A state-dict checkpoint (``moeckpt.save``: no model plan) is written over ``target.dp`` writers, every tensor
    placed on ``mesh`` (default: split along dim 0 over them; :mod:`.state_dict_checkpoints`); ``mesh`` is
    refused for a checkpoint of a bundled model, whose layout is ``target`` alone.

    The new checkpoint has the same step, train state and model, the new layout, new files and checksums, in
    format ``backend`` (default: the source's) with compression setting ``compress`` (default: the source's where
    that format can write it, else ``none``). ``on_bytes`` is called with the bytes of each slab written.
    """
    started = time.perf_counter()
    with paused_gc():  # the index's and headers' parse make many objects too: see paused_gc
        reader = CheckpointReader(src)
        index = reader.index
        _refuse_overlap(reader.location, open_storage(dst).location)
        # A state dict's tensors have no layout rules: the target only sets how many writers hold them.
        if mesh is not None and not is_state_dict(index):
            raise LayoutError(
                f"{reader.location}: a mesh target is for state-dict checkpoints (moeckpt.save); this one records "
                "its model's plan: give --tp/--ep/--dp instead"
            )
        written = sharded_over_writers(index, target, mesh) if is_state_dict(index) else index
        source = OfflineSource(reader.open_reader(), reader.pieces())
        try:
            new_index, plan, bytes_read = convert(
                source,
                written,
                dst,
                target,
                backend=backend or index.backend,
                compress=compress if compress is not None else _kept_compress(index, backend or index.backend),
                overwrite=overwrite,
                on_bytes=on_bytes,
                options=options or ReshardOptions(),
            )
        finally:
            source.pieces.close()
    # The writers checked that every byte of the state was written exactly once (_Writers._check).
    result = ReshardResult(new_index, plan, bytes_read, index.nbytes, time.perf_counter() - started)
    log.info(
        "resharded %s to %s (%s, %s): %d bytes read, %d written in %.2f s",
        reader.location,
        dst,
        target,
        new_index.backend,
        bytes_read,
        index.nbytes,
        result.seconds,
    )
    return result


def _kept_compress(index: Index, backend: str) -> str:
    """The source's compression setting where ``backend`` writes it, else ``none`` (zarr to safetensors)."""
    return index.compress if index.compress in backend_compressions(backend) else NONE


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
    """A :class:`~moeckpt.formats.backend.PieceReader` over a function that yields rows of whole tensors."""

    fork_safe = False  # the function may hold anything (an fsspec filesystem, a Hugging Face reader)

    def __init__(self, read_rows: RowReader, location: str):
        self.location = location
        self._read_rows = read_rows

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        return self._read_rows(ref.tensor, lo, hi) if ref.box.ndim else self._read_rows(ref.tensor, 0, 1)

    def map_rows(self, ref: PieceRef, lo: int, hi: int) -> None:
        return None

    def advise(self, ref: PieceRef, lo: int, hi: int) -> None:
        return None

    def close(self) -> None:
        return None


def write_rows(
    dst: str,
    index: Index,
    target: Layout,
    read_rows: RowReader,
    *,
    source_name: str,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    options: ReshardOptions | None = None,
) -> Index:
    """Write the logical tensors of ``index`` to ``dst`` in layout ``target``, each produced by row ranges.

    ``read_rows(name, r0, r1)`` returns rows ``[r0, r1)`` of the whole logical tensor ``name`` (dim 0; a 0-d
    tensor is asked for rows ``[0, 1)`` and returned as is), in the entry's shape and dtype. Rows are asked for in
    chunks of about ``options.chunk_bytes`` through the same bounded cache as :func:`reshard`, so memory is set by
    a few chunks, never by the model: this is how a Hugging Face model becomes a checkpoint in any layout. The
    format is ``index.backend`` (compressed as ``index.compress``); ``index.files`` is ignored. ``source_name``
    names the source in error messages.
    """
    refs = []  # one whole-tensor piece per logical tensor, whose rows read_rows produces
    for name, entry in index.tensors.items():
        box = Box((0,) * len(entry.shape), tuple(entry.shape))
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        refs.append(PieceRef(name, box, entry.dtype, source_name, 0, nbytes, (), block_bytes=0))
    source = OfflineSource(_RowFunctionReader(read_rows, source_name), refs)
    new_index, _plan, _read = convert(
        source,
        index,
        dst,
        target,
        backend=index.backend,
        compress=index.compress,
        overwrite=overwrite,
        on_bytes=on_bytes,
        options=options or ReshardOptions(),
    )
    return new_index


@dataclass(frozen=True)
class OfflineSource:
    """What an offline run reads: a read session, and the stored pieces it reads from."""

    pieces: PieceReader
    refs: Sequence[PieceRef]


def convert(
    source: OfflineSource,
    index: Index,
    dst: str,
    target: Layout,
    *,
    backend: str,
    compress: str = NONE,
    overwrite: bool,
    on_bytes: Callable[[int], None] | None,
    options: ReshardOptions,
    targets: Mapping[str, Sequence[tuple[Box, int]]] | None = None,
) -> tuple[Index, ReshardPlan, int]:
    """Plan ``index``'s tensors, stored as ``source.refs``, into ``target`` and write them to ``dst``; commit.

    ``targets`` gives the pieces and writers of tensors no sharding rule places (see ``plan_reshard``)."""
    out_backend = get_backend(backend, compress=compress)  # fails early on an unknown format or compression
    sources: dict[str, list[SourcePiece]] = {name: [] for name in index.tensors}
    for ref in source.refs:
        sources[ref.tensor].append(SourcePiece(ref.tensor, ref.box, -1))
    plan = plan_reshard(index, target, sources=sources, targets=targets)
    by_key = {(ref.tensor, ref.box): ref for ref in source.refs}

    # Forked writers share no cache: where no checksum block widens a read (a DCP source), each process reads only
    # the rows its writers need, so a chunk that writers of two processes share is still read once in all.
    unblocked = not any(ref.block_bytes for ref in source.refs)

    def open_chunks(read_threads: int, cache: int, forked: bool = False) -> ChunkReader:
        return ChunkReader(
            source.pieces,
            by_key,
            chunk_bytes=options.chunk_bytes,
            cache_bytes=cache,
            read_threads=read_threads,
            clip=forked and unblocked,
            map_files=True,
        )

    # A state dict keeps its (empty) layout: its meshes or listed pieces say where everything is.
    new_index = replace(
        index,
        backend=backend,
        compress=compress,
        layout={} if is_state_dict(index) else target.to_json(),
        files={},
    )
    storage = begin_save(dst, overwrite=overwrite)
    writers = _Writers(index, plan, storage, out_backend, target, options, by_key)
    forked = (
        options.workers > 1
        and len(plan.ranks) > 1
        and can_fork()
        and source.pieces.fork_safe
        and out_backend.fork_safe
        and storage.fork_safe
    )
    log.debug("reshard to %s: %d writers in %s", dst, len(plan.ranks), "processes" if forked else "threads")
    try:
        with single_threaded_torch(), paused_gc():
            if forked:
                entries, bytes_read = writers.in_processes(open_chunks, on_bytes)
            else:
                entries, bytes_read = writers.in_threads(open_chunks, on_bytes)
        new_index = replace(new_index, files={e.path: e for e in out_backend.finish(storage, entries, index.tensors)})
    except BaseException:
        # Leave nothing behind that looks like a save in progress: the staging data of a failed write goes (local
        # disk), the uploads in flight are aborted (object stores).
        discard(dst)
        raise
    commit(dst, new_index)
    return new_index, plan, bytes_read


class _Writers:
    """Writes every target writer's file of an offline plan, in threads or in forked processes."""

    def __init__(
        self,
        index: Index,
        plan: ReshardPlan,
        storage: Storage,
        out_backend: Backend,
        target: Layout,
        options: ReshardOptions,
        refs: Mapping[tuple[str, Box], PieceRef],
    ):
        self.index, self.plan, self.storage = index, plan, storage
        self.out_backend, self.options = out_backend, options
        self.refs = refs
        boxes: dict[str, list[Box]] = {name: [] for name in index.tensors}
        for rank_plan in plan.ranks:  # every piece the plan writes, whatever placed it
            for piece in rank_plan.pieces:
                if not piece.box.is_empty():
                    boxes[piece.tensor].append(piece.box)
        out_backend.prepare(storage, index.tensors, boxes)

    def groups(self) -> list[list[RankPlan]]:
        """The target writers in groups that read common source chunks (:func:`~.sharing.sharing_groups`)."""

        def chunks_of(item) -> list[tuple[tuple, int]]:
            ref = self.refs.get((item.tensor, item.src_box))
            if ref is None:
                return []  # reported by the chunk cache when the writer reads it
            per = chunk_rows(ref.box, ref.dtype, self.options.chunk_bytes, ref.unit_bytes)
            return [(key, fetched_bytes(ref, key[3], key[4])) for key in chunk_keys(ref, item.rows, per)]

        return sharing_groups(self.plan.ranks, chunks_of, self.options.workers)

    def write_group(
        self, group: Sequence[RankPlan], chunks: ChunkReader, count: Callable[[int], None]
    ) -> list[FileEntry]:
        """Write a group of writers that share source chunks together, in threads over one chunk cache that hands
        each shared chunk to all of them from one read; at most :data:`~.sharing.GROUP_THREADS` at once, in group
        (rank) order, so neighbours on a chain run side by side. Returns their file entries in group order."""

        def one(rank_plan: RankPlan) -> list[FileEntry]:
            with chunks.consumer(rank_plan.rank):
                return self.write(rank_plan, chunks, count)

        if len(group) == 1:
            return one(group[0])
        with ThreadPoolExecutor(min(len(group), GROUP_THREADS), thread_name_prefix="moeckpt-writer") as pool:
            return [e for es in pool.map(one, group) for e in es]

    def in_threads(
        self, open_chunks: Callable[..., ChunkReader], on_bytes: Callable[[int], None] | None
    ) -> tuple[list[FileEntry], int]:
        """Groups of writers (:meth:`groups`) run by ``workers`` threads sharing one chunk cache and ``workers``
        read-ahead threads."""
        written = [0]
        lock = threading.Lock()
        workers = self.options.workers

        def count(n: int) -> None:
            with lock:
                written[0] += n
            if on_bytes is not None:
                on_bytes(n)

        groups = self.groups()
        with open_chunks(workers, self.options.cache_bytes) as chunks, ThreadPoolExecutor(workers) as pool:
            for rp in self.plan.ranks:
                chunks.expect(rp.pieces, reader=rp.rank)
            try:
                entries = [e for es in pool.map(lambda g: self.write_group(g, chunks, count), groups) for e in es]
            except BaseException:
                # Before the pool waits for the other writers: their uploads are refused, so they stop soon.
                self.storage.cancel_uploads()
                raise
        self._check(written[0])
        return entries, chunks.bytes_read

    def in_processes(
        self, open_chunks: Callable[[int, int, bool], ChunkReader], on_bytes: Callable[[int], None] | None
    ) -> tuple[list[FileEntry], int]:
        """Groups of writers (:meth:`groups`) spread over ``workers`` forked processes (balanced by bytes), each
        group's writers in threads, reading with kernel read-ahead, with a share of the cache budget."""
        sharing = self.groups()
        groups = balanced_groups(sharing, [sum(rp.nbytes for rp in g) for g in sharing], self.options.workers)

        def job(bundle: Sequence[Sequence[RankPlan]], report: Callable[[int], None]) -> dict:
            written = [0]
            lock = threading.Lock()  # a group's writer threads count together

            def count(n: int) -> None:
                with lock:
                    written[0] += n
                    report(n)

            with open_chunks(0, self.options.cache_bytes // len(groups), True) as chunks:
                for g in bundle:
                    for rp in g:
                        chunks.expect(rp.pieces, reader=rp.rank)
                files = [e for g in bundle for e in self.write_group(g, chunks, count)]
            return {
                "files": [[e.path, e.size, e.checksum] for e in files],
                "read": chunks.bytes_read,
                "written": written[0],
            }

        done = run_forked(groups, job, on_bytes)
        self._check(sum(d["written"] for d in done))
        files = [FileEntry(path=p, size=n, checksum=c) for d in done for p, n, c in d["files"]]
        return files, sum(d["read"] for d in done)

    def _check(self, written: int) -> None:
        if written != self.index.nbytes:
            raise CheckpointIndexError(f"reshard wrote {written} bytes of {self.index.nbytes}: the plan is incomplete")

    def write(self, rank_plan: RankPlan, chunks: ChunkReader, count: Callable[[int], None]) -> list[FileEntry]:
        """Write one target writer's pieces through its backend's streamed write; returns its file entries."""
        index, options = self.index, self.options
        pieces = rank_plan.pieces
        # A backend that writes each slab before drawing the next gets them all in one reused buffer.
        reuse = self.out_backend.streams_slabs

        def stream() -> Iterator[tuple[int, torch.Tensor]]:
            # Read-ahead by the kernel goes to the page cache, not this process's memory: a wider window.
            window = options.prefetch_bytes if chunks.pool is not None else options.advise_bytes
            for pos, piece in reads_started_ahead(pieces, index, chunks, window):
                for slab in slabs(piece, index.tensors[piece.tensor].dtype, chunks, options.slab_bytes, reuse=reuse):
                    yield pos, slab
                    count(slab.numel() * slab.element_size())

        layout = [(p.tensor, p.box) for p in pieces]
        return self.out_backend.write_stream(
            self.storage, rank_plan.rank, layout, index.tensors, stream(), batch_bytes=options.write_batch_bytes
        )
