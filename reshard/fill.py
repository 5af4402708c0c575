"""Boxes filled from a checkpoint's stored pieces: the one fill loop under every load that reads its own bytes.

A rank's boxes (a load plan's :class:`~.plan.TargetPiece` values, each with its destination tensor) are filled
from the stored pieces behind their reads (:func:`refs_for`; :func:`listed_sources` when the plan was made from
pieces listed by the backend rather than computed from the index): a box whose bytes land in its destination as they
are stored (full-width rows of one stored piece, or one contiguous range of each row) is read straight into it
(:mod:`.inplace`) by the fill threads, verified as it lands, while this thread assembles the others through the
chunk cache (:mod:`.chunks`, :mod:`.slabs`), each stored row read once. :func:`~.load.load_rank_state` (a rank
loading alone) and :func:`~.box_load.load_boxes` (a state dict's or a trainer's live tensors) both call
:func:`fill_boxes`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import Index
from moeckpt.formats.pieces import PieceRef

from .chunks import ChunkReader, reads_started_ahead
from .inplace import Job, in_place_jobs, positions, read_in_place, scattered_jobs
from .options import LoadOptions
from .plan import SourcePiece, TargetPiece
from .slabs import assemble, fill
from .staging import stages


def refs_for(reader: CheckpointReader, sources: set, stored) -> dict[tuple[str, Box], PieceRef]:
    """The stored pieces behind ``sources`` (SourcePiece values): from ``stored`` when the caller listed them
    already, else reading only their writers' headers."""
    if not sources:
        return {}
    if stored is not None:
        return {(s.tensor, s.box): stored[(s.tensor, s.box)] for s in sources}
    refs = reader.pieces(tensors={s.tensor for s in sources}, writers={s.writer for s in sources})
    return {(r.tensor, r.box): r for r in refs}


def listed_sources(refs, names: Collection[str]) -> dict[str, list[SourcePiece]]:
    """Planner sources for pieces that are not placements (zarr cells, named by cell, not writer): every piece gets
    writer 0, the same on every rank."""
    sources: dict[str, list[SourcePiece]] = {name: [] for name in names}
    for ref in refs:
        sources[ref.tensor].append(SourcePiece(ref.tensor, ref.box, 0))
    return sources


def fill_boxes(
    reader: CheckpointReader,
    refs: Mapping[tuple[str, Box], PieceRef],
    pieces: Sequence[TargetPiece],
    dests: list[torch.Tensor],
    options: LoadOptions,
    *,
    threads: int = 1,
    own: Collection[int] = (),
) -> int:
    """Fill ``dests[pos]`` with the box of ``pieces[pos]`` from the stored pieces ``refs``; returns the data bytes
    read from storage.

    A destination of the stored dtype, contiguous, on the CPU or on a device (through pinned staging, joined
    boxes scattered into place) is read straight into where its bytes land as they are; the others are assembled
    through the chunk cache, ``threads`` boxes at a time. A position in ``own`` is a new CPU tensor of the
    caller's own: the assembled tensor itself (the read chunk where it is one) takes its place in ``dests`` instead
    of a copy. A destination of another dtype is assembled on the host and copied over once (converting).
    """
    index = reader.index
    jobs: list[Job] = []
    staged_rest = []  # staged boxes that are not read straight into place: their rows may be scattered there
    for pos, piece in enumerate(pieces):
        if _takes_stored_bytes(dests[pos], index.tensors[piece.tensor].dtype):
            found = in_place_jobs(pos, piece, refs, dests[pos])
            jobs += found
            if not found and stages(dests[pos]):
                staged_rest.append(pos)
    jobs += scattered_jobs(pieces, dests, staged_rest, refs)
    direct = {pos for job in jobs for pos in positions(job)}
    with ChunkReader(
        reader,
        refs,
        chunk_bytes=options.chunk_bytes,
        cache_bytes=options.cache_bytes,
        read_threads=options.read_threads,
        clip=True,
    ) as chunks:
        with ThreadPoolExecutor(1) as one:
            in_place = one.submit(
                read_in_place,
                chunks,
                jobs,
                options.fill_threads,
                options.chunk_bytes,
                options.stage_bytes,
                options.mapped_bytes,
                options.checksums_on_device,
            )
            try:
                rest = [pos for pos in range(len(pieces)) if pos not in direct]
                _assemble_into(chunks, index, pieces, dests, rest, own, options.prefetch_bytes, threads)
            finally:
                failed, fetched = in_place.result()
        # what the session could not read in place after all
        _assemble_into(chunks, index, pieces, dests, sorted(failed), own, options.prefetch_bytes, 1)
    return chunks.bytes_read + fetched


def _takes_stored_bytes(dest: torch.Tensor, dtype: str) -> bool:
    """Whether a stored piece's bytes can land in ``dest`` as they are (a contiguous tensor of its dtype, on the
    CPU or on a device)."""
    return dest.dtype == dtypes.to_torch(dtype) and dest.is_contiguous()


def _assemble_into(
    chunks: ChunkReader,
    index: Index,
    pieces: Sequence[TargetPiece],
    dests: list[torch.Tensor],
    positions: list[int],
    own: Collection[int],
    window: int,
    threads: int,
) -> None:
    """Fill ``dests[pos]`` for ``positions`` through the chunk cache, ``threads`` boxes at a time (the copies
    release the interpreter lock)."""
    todo = [pieces[p] for p in positions]

    def one(k: int, piece: TargetPiece) -> None:
        pos = positions[k]
        dtype = index.tensors[piece.tensor].dtype
        dest = dests[pos]
        if pos in own:
            dests[pos] = assemble(piece, dtype, chunks)
        elif dest.device.type == "cpu" and dest.dtype == dtypes.to_torch(dtype):
            fill(dest, piece.box, piece.reads, chunks)
        else:  # on a device or of another dtype: assembled on the host, one copy over
            dest.copy_(assemble(piece, dtype, chunks))

    if threads <= 1 or len(todo) <= 1:
        for k, piece in reads_started_ahead(todo, index, chunks, window):
            one(k, piece)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-assemble") as pool:
        running: list = []
        for k, piece in reads_started_ahead(todo, index, chunks, window):
            running.append(pool.submit(one, k, piece))
            if len(running) >= 2 * threads:  # boxes in flight stay few: their chunks stay within the cache
                running.pop(0).result()
        for fut in running:
            fut.result()
