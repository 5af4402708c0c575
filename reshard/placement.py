"""Which boxes of each logical tensor a rank holds, and which rank writes each distinct piece.

Pure functions of (tensor entry, layout, rank): no processes, no I/O. Saving, loading and planning all call
these, so a checkpoint's pieces can be located from its index alone.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

from moeckpt.formats.box import Box
from moeckpt.formats.index import TensorEntry

from .layout import Layout
from .rules import ShardingRule, check_rule, tp_ranges

#: roles whose tensors ZeRO-1 splits across the (expert-)data-parallel group.
ZERO_ROLES = frozenset({"master", "exp_avg", "exp_avg_sq"})


def rule_of(entry: TensorEntry) -> ShardingRule:
    return ShardingRule.from_json(entry.sharding, f"tensor {entry.name!r}")


def check_tensor(entry: TensorEntry, layout: Layout) -> None:
    check_rule(rule_of(entry), entry.shape, layout.tp, layout.ep, entry.name)


def model_parallel_boxes(entry: TensorEntry, layout: Layout, tp_rank: int, ep_rank: int) -> list[Box]:
    """The boxes of the TP/EP-local tensor, in the order the local tensor concatenates them along the TP dim."""
    rule = rule_of(entry)
    shape = entry.shape
    offsets = [0] * len(shape)
    sizes = list(shape)
    if rule.expert_dim is not None:
        per = shape[rule.expert_dim] // layout.ep
        offsets[rule.expert_dim] = ep_rank * per
        sizes[rule.expert_dim] = per
    if rule.tp is None:
        return [Box(tuple(offsets), tuple(sizes))]
    out = []
    for lo, hi in tp_ranges(rule, shape, layout.tp, tp_rank, entry.name):
        o, s = list(offsets), list(sizes)
        o[rule.tp.dim], s[rule.tp.dim] = lo, hi - lo
        out.append(Box(tuple(o), tuple(s)))
    return out


def zero_part(boxes: list[Box], concat_dim: int | None, parts: int, part: int) -> list[Box]:
    """Part ``part`` of ``parts`` of the local tensor made of ``boxes``, split along its dim 0.

    ``concat_dim`` is the dimension along which ``boxes`` concatenate (the TP dim). Each part has
    ``ceil(rows / parts)`` rows, so the last may be short and trailing ones empty; everything stays a box.
    """
    if not boxes or boxes[0].ndim == 0:
        return list(boxes) if part == 0 else []
    if concat_dim == 0:
        rows = sum(b.shape[0] for b in boxes)
    else:
        rows = boxes[0].shape[0]
    chunk = -(-rows // parts)
    lo, hi = min(part * chunk, rows), min((part + 1) * chunk, rows)
    out = []
    start = 0
    for b in boxes:
        if concat_dim == 0:
            b_lo, b_hi = start, start + b.shape[0]
            start = b_hi
        else:
            b_lo, b_hi = 0, b.shape[0]
        r0, r1 = max(lo, b_lo), min(hi, b_hi)
        if r1 > r0:
            offs = (b.offsets[0] + r0 - b_lo,) + b.offsets[1:]
            out.append(Box(offs, (r1 - r0,) + b.shape[1:]))
    return out


def rank_boxes(entry: TensorEntry, layout: Layout, rank: int) -> list[Box]:
    """Every box of ``entry`` that ``rank`` holds in ``layout`` (its local tensor, as boxes)."""
    c = layout.coords(rank)
    rule = rule_of(entry)
    boxes = model_parallel_boxes(entry, layout, c.tp_rank, c.ep_rank)
    if entry.role in ZERO_ROLES:
        if rule.expert_dim is not None:
            parts, part = layout.edp, c.edp_rank
        else:
            parts, part = layout.dp, c.dp_rank
        concat = rule.tp.dim if rule.tp is not None else None
        boxes = zero_part(boxes, concat, parts, part)
    return [b for b in boxes if not b.is_empty()]


@dataclass(frozen=True)
class Placement:
    """One distinct stored piece: its box and the rank that writes it (one writer even when replicated)."""

    box: Box
    writer: int


_CACHE: dict[tuple, tuple[Placement, ...]] = {}


def placements(entry: TensorEntry, layout: Layout) -> list[Placement]:
    """Every distinct piece of ``entry`` in ``layout`` with its writer, in box order.

    Replicated pieces (parameters are replicated over data-parallel ranks, unsplit ones over TP ranks too) are
    written once; the writer rotates over the replicas with the piece index and the tensor name, so the write
    volume spreads evenly over the ranks.
    """
    key = (entry.name, entry.shape, entry.role, json.dumps(entry.sharding, sort_keys=True), layout)
    cached = _CACHE.get(key)
    if cached is None:
        cached = _CACHE[key] = _compute_placements(entry, layout)
        if len(_CACHE) > 100_000:
            _CACHE.clear()
    return list(cached)


def _compute_placements(entry: TensorEntry, layout: Layout) -> tuple[Placement, ...]:
    holders: dict[Box, list[int]] = {}
    for rank in range(layout.world):
        for b in rank_boxes(entry, layout, rank):
            holders.setdefault(b, []).append(rank)
    seed = zlib.crc32(entry.name.encode())
    return tuple(Placement(box, ranks[(seed + i) % len(ranks)]) for i, (box, ranks) in enumerate(sorted(holders.items())))


def pieces_written_by(entry: TensorEntry, layout: Layout, rank: int) -> list[Box]:
    """The boxes of ``entry`` that ``rank`` writes when saving in ``layout``."""
    return [p.box for p in placements(entry, layout) if p.writer == rank]
