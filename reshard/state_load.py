"""Loading a checkpoint into the state dicts of a group, in place: each rank reads only the bytes its tensors need.

The caller's state dict says what to load and where: every tensor leaf (a DTensor on any mesh, or a plain tensor)
is filled in place from the checkpoint, whatever mesh or layout saved it (the boxes its local tensor holds are
planned against the checkpoint's stored pieces, :func:`~moeckpt.reshard.planner.plan_boxes`); JSON values are put
back into the caller's dict and returned. Everything is validated before a byte is copied (keys, global shapes,
dtypes), and over a group the ranks agree on the outcome, so a mismatch is the same one-line error on every rank,
nothing half-loaded, no rank left waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import (
    ChecksumMismatchError,
    DataFileError,
    MoeckptError,
    StorageError,
)

from . import collectives
from .chunks import ChunkReader, reads_started_ahead
from .inplace import Job, in_place_jobs, read_in_place
from .load import LoadStats, _refs_for
from .mesh import local_boxes
from .options import LoadOptions
from .placement import is_stored
from .planner import SourcePiece, plan_boxes
from .runtime import paused_gc, single_threaded_torch
from .slabs import fill
from .state_dict import Leaf, StateDictError, flatten, leaf_of, set_flat
from .state_save import group_rank_of

__all__ = ["load_boxes", "load_state_dict"]

log = logging.getLogger(__name__)

#: errors a failed read is raised as on every rank of the group; others become StateDictError.
_SHARED = {cls.__name__: cls for cls in (ChecksumMismatchError, DataFileError, StorageError, StateDictError)}


def _agree(error: BaseException | None, group, where: str) -> None:
    """Collective: if any rank failed, every rank raises the same error class (the failing rank's message)."""
    notes = collectives.all_gather_json(None if error is None else [type(error).__name__, str(error)], group)
    if error is not None:
        raise _SHARED.get(type(error).__name__, StateDictError)(str(error)) from None
    for g, other in enumerate(notes):
        if other is not None:
            raise _SHARED.get(other[0], StateDictError)(f"{where}: rank {g} of the group could not load: {other[1]}")


def _targets(leaf: Leaf, rank: int) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of this rank's local tensor of ``leaf``, each with the view of the local tensor it fills."""
    local = leaf.local
    if leaf.kind == "tensor":
        return [(Box.full(leaf.shape), local)]
    coord = _coord(leaf.mesh_ranks, leaf.mesh_shape, rank)
    out = []
    for box, offsets in local_boxes(leaf.shape, leaf.mesh_shape, coord, leaf.placements):
        if box.is_empty():
            continue
        view = local[tuple(slice(o, o + s) for o, s in zip(offsets, box.shape))] if box.ndim else local
        out.append((box, view))
    return out


def _coord(ranks: tuple[int, ...], shape: tuple[int, ...], rank: int) -> list[int]:
    flat = ranks.index(rank)
    out = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        out.append(r)
    return list(reversed(out))


def _check(leaf: Leaf, reader: CheckpointReader) -> None:
    entry = reader.index.tensors.get(leaf.key)
    if entry is None:
        raise StateDictError(
            f"{reader.location}: the checkpoint has no tensor {leaf.key!r} (it holds {len(reader.index.tensors)}, "
            f"e.g. {sorted(reader.index.tensors)[:3]}); the state dict does not match it"
        )
    if entry.shape != leaf.shape or entry.dtype != leaf.dtype:
        raise StateDictError(
            f"{reader.location}: tensor {leaf.key!r} is {list(entry.shape)} {entry.dtype} in the checkpoint, "
            f"{list(leaf.shape)} {leaf.dtype} in the state dict"
        )


def load_state_dict(
    state_dict: MutableMapping[str, Any],
    location: str,
    *,
    group=None,
    stats: LoadStats | None = None,
    options: LoadOptions | None = None,
) -> dict[str, Any]:
    """Fill ``state_dict``'s tensors in place from the checkpoint at ``location``; put its JSON values back into
    ``state_dict`` and return every JSON value the checkpoint holds (by flattened key). Collective over ``group``.
    """
    started = time.perf_counter()
    stats = stats if stats is not None else LoadStats()
    rank = collectives.rank(group)
    to_group = group_rank_of(group)
    error: BaseException | None = None
    reader = None
    wanted: list[tuple[Leaf, Box, torch.Tensor]] = []
    values: list[tuple[str, tuple, Any]] = []
    # no_grad: a DTensor's to_local() is then its local tensor itself, not a view with an autograd node
    with single_threaded_torch(), paused_gc(), torch.no_grad():
        try:
            reader = CheckpointReader(location)
            for key, (path, value) in flatten(state_dict).items():
                leaf = leaf_of(key, value, to_group_rank=to_group)
                if leaf.kind == "value":
                    if key not in reader.index.train_state:
                        raise StateDictError(f"{reader.location}: the checkpoint has no value {key!r}")
                    values.append((key, path, reader.index.train_state[key]))
                    continue
                _check(leaf, reader)
                wanted.extend((leaf, box, view) for box, view in _targets(leaf, rank))
        except (MoeckptError, OSError) as e:
            error = e
        where = reader.location if reader is not None else location
        _agree(error, group, where)
        if reader is None:  # unreachable: _agree raised the open's error on every rank
            raise StateDictError(f"{location}: the checkpoint could not be opened")
        try:
            _read_into(
                reader, [(leaf.key, box, view) for leaf, box, view in wanted], rank, stats, options or LoadOptions()
            )
        except (MoeckptError, OSError) as e:
            error = e
        _agree(error, group, where)
    for _, path, value in values:
        set_flat(state_dict, path, value)
    stats.bytes_needed = sum(box.numel * dtypes.itemsize(leaf.dtype) for leaf, box, _ in wanted)
    stats.seconds = time.perf_counter() - started
    log.info(
        "loaded %s: %.1f MB read for %.1f MB in %.2f s",
        where,
        stats.bytes_read / 1e6,
        stats.bytes_needed / 1e6,
        stats.seconds,
    )
    return dict(reader.index.train_state)


def needs_listing(reader: CheckpointReader, name: str) -> bool:
    """Whether the stored pieces of ``name`` are found by listing them (zarr cells, DCP-written pieces) rather
    than computed from its sharding rule."""
    return not reader.backend.stores_placements or is_stored(reader.index.tensors[name])


def load_boxes(
    location: str | CheckpointReader,
    wanted: list[tuple[str, Box, torch.Tensor]],
    *,
    group=None,
    stats: LoadStats | None = None,
    options: LoadOptions | None = None,
) -> CheckpointReader:
    """Fill each ``(tensor name, box, view)`` of ``wanted`` from the checkpoint: ``view`` holds ``box`` (global
    coordinates) of the tensor, on any device and in any floating dtype (converted on copy). What a trainer whose
    live tensors are boxes (the bundled one's parameters and ZeRO parts) loads a state-dict checkpoint with.
    Collective over ``group``: names and boxes are checked first, and the ranks agree on the outcome."""
    started = time.perf_counter()
    stats = stats if stats is not None else LoadStats()
    error: BaseException | None = None
    reader = location if isinstance(location, CheckpointReader) else None
    with single_threaded_torch(), paused_gc():
        try:
            reader = reader or CheckpointReader(str(location))
            for name, box, view in wanted:
                entry = reader.index.tensors.get(name)
                if entry is None:
                    raise StateDictError(f"{reader.location}: the checkpoint has no tensor {name!r}")
                if not box.within(entry.shape) or tuple(view.shape) != box.shape:
                    raise StateDictError(
                        f"{reader.location}: tensor {name!r} {list(entry.shape)} has no box "
                        f"{box.to_json()} of shape {list(view.shape)}"
                    )
        except (MoeckptError, OSError) as e:
            error = e
        where = reader.location if reader is not None else str(location)
        _agree(error, group, where)
        if reader is None:  # unreachable: _agree raised the open's error on every rank
            raise StateDictError(f"{location}: the checkpoint could not be opened")
        try:
            _read_into(reader, wanted, collectives.rank(group), stats, options or LoadOptions())
        except (MoeckptError, OSError) as e:
            error = e
        _agree(error, group, where)
    stats.bytes_needed = sum(box.numel * view.element_size() for _, box, view in wanted)
    stats.seconds = time.perf_counter() - started
    return reader


def _read_into(reader: CheckpointReader, wanted, rank: int, stats: LoadStats, options: LoadOptions) -> None:
    names = {name for name, _, _ in wanted}
    listed = {n for n in names if needs_listing(reader, n)}
    stored = {(r.tensor, r.box): r for r in reader.pieces(tensors=listed)} if listed else None
    sources: dict[str, list[SourcePiece]] | None = None
    if stored is not None:
        found: dict[str, list[SourcePiece]] = {n: [] for n in listed}
        for ref in stored.values():
            found[ref.tensor].append(SourcePiece(ref.tensor, ref.box, 0))
        sources = found
    plan = plan_boxes(reader.index, {rank: [(name, box) for name, box, _ in wanted]}, sources=sources)
    (rank_plan,) = plan.ranks
    refs = {}
    by_rule = {r.source for p in rank_plan.pieces for r in p.reads if stored is None or r.tensor not in listed}
    refs.update(_refs_for(reader, by_rule, None))
    if stored is not None:
        refs.update(
            {
                (r.tensor, r.src_box): stored[(r.tensor, r.src_box)]
                for p in rank_plan.pieces
                for r in p.reads
                if r.tensor in listed
            }
        )
    views = [view for _, _, view in wanted]
    index = reader.index
    pieces = rank_plan.pieces
    # A box whose every stored source row lands in one contiguous range of each of its rows (full-width rows of
    # one stored piece, TP halves of a matrix loaded whole, an expert's TP slice), into a CPU tensor of the stored
    # dtype that is contiguous, is read straight into it by the fill threads (verified as it lands); this thread
    # assembles the others through the chunk cache meanwhile.
    jobs: list[Job] = []
    for pos, piece in enumerate(pieces):
        if _takes_bytes(views[pos], index.tensors[piece.tensor].dtype):
            jobs += in_place_jobs(pos, piece, refs, views[pos])
    direct = {job[0] for job in jobs}
    with ChunkReader(
        reader,
        refs,
        chunk_bytes=options.chunk_bytes,
        cache_bytes=options.cache_bytes,
        read_threads=options.read_threads,
        clip=True,
    ) as chunks:
        with ThreadPoolExecutor(1) as one:
            in_place = one.submit(read_in_place, chunks, jobs, options.fill_threads, options.chunk_bytes)
            try:
                rest = [pos for pos in range(len(pieces)) if pos not in direct]
                _fill_boxes(chunks, index, pieces, views, rest, options.prefetch_bytes)
            finally:
                failed, fetched = in_place.result()
        _fill_boxes(chunks, index, pieces, views, sorted(failed), options.prefetch_bytes)  # not readable in place
    stats.bytes_read += chunks.bytes_read + fetched


def _takes_bytes(view: torch.Tensor, dtype: str) -> bool:
    """Whether a stored piece's bytes can land in ``view`` as they are (a contiguous CPU tensor of its dtype)."""
    return view.device.type == "cpu" and view.dtype == dtypes.to_torch(dtype) and view.is_contiguous()


def _fill_boxes(chunks: ChunkReader, index, pieces, views: list[torch.Tensor], positions, window: int) -> None:
    """Assemble the boxes at ``positions`` through the chunk cache into their views (through a host tensor for a
    view on a device or of another dtype)."""
    todo = [pieces[p] for p in positions]
    for k, piece in reads_started_ahead(todo, index, chunks, window):
        out = views[positions[k]]
        if out.device.type == "cpu" and out.dtype == dtypes.to_torch(index.tensors[piece.tensor].dtype):
            fill(out, piece.box, piece.reads, chunks)
        else:  # a device tensor: assemble on the host, one copy over
            host = torch.empty(piece.box.shape, dtype=dtypes.to_torch(index.tensors[piece.tensor].dtype))
            fill(host, piece.box, piece.reads, chunks)
            out.copy_(host)
