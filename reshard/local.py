"""A rank's local tensor and the boxes it is made of: the one home of local-tensor geometry.

A rank's local tensor of a logical tensor is the concatenation of its boxes (``placement.rank_boxes``) along the
TP dimension: one box for a plain split, several for fused blocks (gate/up, q/k conv channels), possibly none for
a window split that misses the rank. ZeRO parts (optimizer roles) are rows of the TP/EP-local tensor, the same
boxes cut along dim 0, so an empty part is that tensor with no rows. These functions convert between the local
tensor a trainer (or a load) holds and the boxes a checkpoint stores. A DTensor's local tensor on a device mesh
is :mod:`.mesh`'s (:func:`~.mesh.mesh_local_shape`, :func:`~.mesh.local_boxes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import ZERO_ROLES

from .layout import Layout
from .placement import model_parallel_boxes, rank_boxes, rule_of


def concat_dim(entry: TensorEntry) -> int:
    """The dimension along which a rank's boxes of ``entry`` concatenate into its local tensor."""
    dim = rule_of(entry).concat_dim
    return 0 if dim is None else dim


def joined_shape(boxes: Sequence[Box], concat: int | None) -> tuple[int, ...]:
    """The shape of the tensor made of ``boxes`` (at least one) concatenated along ``concat`` (``None``: one box)."""
    shape = list(boxes[0].shape)
    if concat is not None:
        shape[concat] = sum(b.shape[concat] for b in boxes)
    return tuple(shape)


def model_parallel_shape(entry: TensorEntry, layout: Layout, rank: int) -> tuple[int, ...]:
    """Shape of the rank's TP/EP-local tensor of ``entry`` (before any ZeRO split): what a module's parameter is."""
    c = layout.coords(rank)
    return joined_shape(model_parallel_boxes(entry, layout, c.tp_rank, c.ep_rank), rule_of(entry).concat_dim)


def local_shape(entry: TensorEntry, layout: Layout, rank: int) -> tuple[int, ...]:
    """Shape of the rank's local tensor: its boxes joined; where it holds none, the TP/EP-local tensor with no
    rows (an empty ZeRO part) or with nothing along the TP dim (a window split that misses the rank)."""
    if not entry.shape:
        return ()
    boxes = rank_boxes(entry, layout, rank)
    if boxes:
        return joined_shape(boxes, concat_dim(entry))
    shape = list(model_parallel_shape(entry, layout, rank))
    if entry.role in ZERO_ROLES:
        shape[0] = 0
    else:
        shape[concat_dim(entry)] = 0
    return tuple(shape)


def local_views(entry: TensorEntry, layout: Layout, rank: int) -> list[tuple[Box, int, int, int]]:
    """Where each box of the rank sits in its local tensor: ``(box, dim, start, length)``, the box being
    ``local.narrow(dim, start, length)`` (a 0-d tensor's one box is the whole local tensor, with length 0)."""
    dim, start, out = concat_dim(entry), 0, []
    for box in rank_boxes(entry, layout, rank):
        length = box.shape[dim] if box.ndim else 0
        out.append((box, dim, start, length))
        start += length
    return out


def slices_in_local(box: Box, boxes: Sequence[Box], concat: int | None, first_row: int = 0) -> tuple[slice, ...]:
    """Where ``box`` (inside one of ``boxes``) sits in the tensor made of ``boxes`` joined along ``concat``, with
    rows counted from ``first_row`` of it (a ZeRO part starting at that row)."""
    start = 0
    for m in boxes:
        if m.contains(box):
            rel = list(box.relative_to(m).offsets)
            if concat is not None:
                rel[concat] += start
            if rel:
                rel[0] -= first_row
            return tuple(slice(o, o + s) for o, s in zip(rel, box.shape))
        if concat is not None:
            start += m.shape[concat]
    raise LayoutError(f"box {box.to_json()} lies in none of the boxes {[b.to_json() for b in boxes]}; this is a bug")


def split_local(entry: TensorEntry, layout: Layout, rank: int, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of ``entry`` that ``rank`` holds, each with the view of ``local`` holding its data."""
    want = local_shape(entry, layout, rank)
    if tuple(local.shape) != want:
        raise LayoutError(
            f"{entry.name}: rank {rank} holds a local tensor of shape {tuple(local.shape)}, layout {layout} "
            f"expects {want}"
        )
    if not entry.shape:
        return [(b, local) for b in rank_boxes(entry, layout, rank)]
    return [(b, local.narrow(dim, start, length)) for b, dim, start, length in local_views(entry, layout, rank)]


def local_parts(
    entry: TensorEntry, layout: Layout, rank: int, pieces: Mapping[Box, torch.Tensor]
) -> tuple[list[torch.Tensor], int | None]:
    """What :func:`join_local` joins: ``([local tensor], None)`` where one piece (or none) is the rank's local
    tensor as it is, else the rank's pieces in order and the dimension they are concatenated along."""
    boxes = rank_boxes(entry, layout, rank)
    missing = [b.to_json() for b in boxes if b not in pieces]
    if missing:
        raise LayoutError(f"{entry.name}: rank {rank} lacks boxes {missing} to build its local tensor")
    if not entry.shape and boxes:
        return [pieces[boxes[0]]], None
    if not boxes:  # an empty ZeRO part (of a 0-d tensor too: its one element lives on part 0)
        return [torch.empty(local_shape(entry, layout, rank), dtype=dtypes.to_torch(entry.dtype))], None
    if len(boxes) == 1:
        return [pieces[boxes[0]]], None
    return [pieces[b] for b in boxes], concat_dim(entry)


def join_local(entry: TensorEntry, layout: Layout, rank: int, pieces: Mapping[Box, torch.Tensor]) -> torch.Tensor:
    """The rank's local tensor from the data of each of its boxes."""
    parts, dim = local_parts(entry, layout, rank, pieces)
    return parts[0] if dim is None else torch.cat(parts, dim=dim)
