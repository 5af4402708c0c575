"""Filling boxes of tensors from a checkpoint, in place: each rank reads only the bytes its boxes need.

The engine under every in-place load: ``(tensor name, box, view)`` triples are planned against the checkpoint's
stored pieces (:func:`~moeckpt.reshard.planner.plan_boxes`), read once through the chunk cache (or straight into
the view where its bytes land as they are) and verified as they land, by the fill loop a rank loading its own
layout alone runs too (:func:`~.fill.fill_boxes`). The library's state-dict loads
(:mod:`moeckpt.library.state_load`) and the trainer's resume (whose live tensors are boxes) both call it.
"""

from __future__ import annotations

import time

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError, MoeckptError, StateDictError, StorageError

from . import collectives
from .fill import fill_boxes, listed_sources, refs_for
from .load import LoadStats
from .options import LoadOptions
from .placement import is_stored
from .planner import plan_boxes
from .runtime import paused_gc, single_threaded_torch

__all__ = ["agree_on_load", "load_boxes", "needs_listing", "read_boxes_into"]

#: errors a failed read is raised as on every rank of the group; others become StateDictError.
_SHARED = {cls.__name__: cls for cls in (ChecksumMismatchError, DataFileError, StorageError, StateDictError)}


def agree_on_load(error: BaseException | None, group, where: str) -> None:
    """Collective: if any rank failed, every rank raises the same error class (the failing rank's message)."""
    notes = collectives.all_gather_json(None if error is None else [type(error).__name__, str(error)], group)
    if error is not None:
        raise _SHARED.get(type(error).__name__, StateDictError)(str(error)) from None
    for g, other in enumerate(notes):
        if other is not None:
            raise _SHARED.get(other[0], StateDictError)(f"{where}: rank {g} of the group could not load: {other[1]}")


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
        agree_on_load(error, group, where)
        if reader is None:  # unreachable: _agree raised the open's error on every rank
            raise StateDictError(f"{location}: the checkpoint could not be opened")
        try:
            read_boxes_into(reader, wanted, collectives.rank(group), stats, options or LoadOptions())
        except (MoeckptError, OSError) as e:
            error = e
        agree_on_load(error, group, where)
    stats.bytes_needed = sum(box.numel * view.element_size() for _, box, view in wanted)
    stats.seconds = time.perf_counter() - started
    return reader


def read_boxes_into(reader: CheckpointReader, wanted, rank: int, stats: LoadStats, options: LoadOptions) -> None:
    names = {name for name, _, _ in wanted}
    listed = {n for n in names if needs_listing(reader, n)}
    stored = {(r.tensor, r.box): r for r in reader.pieces(tensors=listed)} if listed else None
    sources = None if stored is None else listed_sources(stored.values(), listed)
    plan = plan_boxes(reader.index, {rank: [(name, box) for name, box, _ in wanted]}, sources=sources)
    (rank_plan,) = plan.ranks
    refs = {}
    by_rule = {r.source for p in rank_plan.pieces for r in p.reads if stored is None or r.tensor not in listed}
    refs.update(refs_for(reader, by_rule, None))
    if stored is not None:
        refs.update(
            {
                (r.tensor, r.src_box): stored[(r.tensor, r.src_box)]
                for p in rank_plan.pieces
                for r in p.reads
                if r.tensor in listed
            }
        )
    # A view of the stored dtype that is contiguous is filled in place by the fill threads (verified as it lands):
    # in host memory straight from the file, in device memory through pinned staging (a box joined from several
    # stored pieces scattered there by device copies); the others are assembled through the chunk cache meanwhile,
    # a view of another dtype through a host tensor, converted on its copy.
    views = [view for _, _, view in wanted]
    stats.bytes_read += fill_boxes(reader, refs, rank_plan.pieces, views, options)
