"""A rank's local tensor and the boxes it is made of.

A rank's local tensor of a logical tensor is the concatenation of its boxes (``placement.rank_boxes``) along the
TP dimension: one box for a plain split, several for fused blocks (gate/up, q/k conv channels), possibly none for
a window split that misses the rank. ZeRO parts follow the same rule. These two functions convert between the
local tensor a trainer holds and the boxes a checkpoint stores.
"""

from __future__ import annotations

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import TensorEntry

from .layout import Layout
from .placement import rank_boxes, rule_of


def concat_dim(entry: TensorEntry) -> int:
    """The dimension along which a rank's boxes of ``entry`` concatenate into its local tensor."""
    rule = rule_of(entry)
    return rule.tp.dim if rule.tp is not None else 0


def local_shape(entry: TensorEntry, layout: Layout, rank: int) -> tuple[int, ...]:
    """Shape of the rank's local tensor (zero along the concat dim when it holds nothing)."""
    boxes = rank_boxes(entry, layout, rank)
    dim = concat_dim(entry)
    if not entry.shape:
        return ()
    if not boxes:
        shape = list(entry.shape)
        shape[dim] = 0
        return tuple(shape)
    shape = list(boxes[0].shape)
    shape[dim] = sum(b.shape[dim] for b in boxes)
    return tuple(shape)


def split_local(entry: TensorEntry, layout: Layout, rank: int, local: torch.Tensor) -> list[tuple[Box, torch.Tensor]]:
    """The boxes of ``entry`` that ``rank`` holds, each with the view of ``local`` holding its data."""
    want = local_shape(entry, layout, rank)
    if tuple(local.shape) != want:
        raise LayoutError(
            f"{entry.name}: rank {rank} holds a local tensor of shape {tuple(local.shape)}, layout {layout} "
            f"expects {want}"
        )
    boxes = rank_boxes(entry, layout, rank)
    if not entry.shape:
        return [(b, local) for b in boxes]
    dim = concat_dim(entry)
    out = []
    start = 0
    for b in boxes:
        out.append((b, local.narrow(dim, start, b.shape[dim])))
        start += b.shape[dim]
    return out


def join_local(entry: TensorEntry, layout: Layout, rank: int, pieces: dict[Box, torch.Tensor]) -> torch.Tensor:
    """The rank's local tensor from the data of each of its boxes."""
    boxes = rank_boxes(entry, layout, rank)
    missing = [b.to_json() for b in boxes if b not in pieces]
    if missing:
        raise LayoutError(f"{entry.name}: rank {rank} lacks boxes {missing} to build its local tensor")
    if not entry.shape:
        return pieces[boxes[0]]
    if not boxes:
        from moeckpt.formats import dtypes

        return torch.empty(local_shape(entry, layout, rank), dtype=dtypes.to_torch(entry.dtype))
    if len(boxes) == 1:
        return pieces[boxes[0]]
    return torch.cat([pieces[b] for b in boxes], dim=concat_dim(entry))
