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
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import MoeckptError, StateDictError
from moeckpt.reshard import collectives
from moeckpt.reshard.box_load import agree_on_load, read_boxes_into
from moeckpt.reshard.load import LoadStats
from moeckpt.reshard.mesh import local_boxes
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.runtime import paused_gc, single_threaded_torch

from .state_dict import Leaf, flatten, leaf_of, set_flat
from .state_save import group_rank_of

__all__ = ["load_state_dict"]

log = logging.getLogger(__name__)


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
        agree_on_load(error, group, where)
        if reader is None:  # unreachable: _agree raised the open's error on every rank
            raise StateDictError(f"{location}: the checkpoint could not be opened")
        try:
            read_boxes_into(
                reader, [(leaf.key, box, view) for leaf, box, view in wanted], rank, stats, options or LoadOptions()
            )
        except (MoeckptError, OSError) as e:
            error = e
        agree_on_load(error, group, where)
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
