"""Which boxes of each logical tensor a rank holds, and which rank writes each distinct piece.

Pure functions of (tensor entry, layout, rank): no processes, no I/O. Saving, loading and planning all call
these, so a checkpoint's pieces can be located from its index alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moeckpt.formats.box import Box
from moeckpt.formats.index import STORED_SHARDING, TensorEntry
from moeckpt.formats.roles import ZERO_ROLES

from . import mesh
from .layout import Layout
from .rules import ShardingRule, check_rule, tp_ranges

#: the sharding of a tensor whose pieces and their writers are listed only by the data files' headers (what a
#: ``dcp.save`` through ``moeckpt.dcp.StorageWriter`` writes: DCP picks the writer of each replicated chunk).
STORED = STORED_SHARDING


def is_stored(entry: TensorEntry) -> bool:
    """Whether ``entry``'s pieces must be read from the data files' headers (no rule computes them)."""
    return entry.sharding == STORED


def rule_of(entry: TensorEntry) -> ShardingRule:
    if is_stored(entry) or entry.mesh is not None:
        from moeckpt.formats.errors import LayoutError

        raise LayoutError(
            f"tensor {entry.name!r} has no layout rule (its sharding is {entry.sharding}): it holds a library or DCP "
            "state dict, not a bundled model's layout; load it with moeckpt.load, or give --model to map it"
        )
    return ShardingRule.from_json(entry.sharding, f"tensor {entry.name!r}")


def check_tensor(entry: TensorEntry, layout: Layout) -> None:
    if entry.mesh is not None:  # a device-mesh sharding does not depend on the layout; its placements must parse
        mesh.entry_placements(entry)
        return
    if is_stored(entry):
        return
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


_RANK_CACHE: dict[tuple, tuple[Box, ...]] = {}


def rank_boxes(entry: TensorEntry, layout: Layout, rank: int) -> list[Box]:
    """Every box of ``entry`` that ``rank`` holds in ``layout`` (its local tensor, as boxes); a tensor with a
    device-mesh sharding ignores ``layout`` (its mesh says where it lives)."""
    if entry.mesh is not None:
        return mesh.entry_rank_boxes(entry, rank)
    # Same-structure tensors (one parameter in every layer) hold the same boxes: computed once, shared.
    key = (entry.shape, entry.role in ZERO_ROLES, entry.sharding_key, layout, rank)
    found = _RANK_CACHE.get(key)
    if found is None:
        if len(_RANK_CACHE) > 200_000:
            _RANK_CACHE.clear()
        found = _RANK_CACHE[key] = tuple(_rank_boxes(entry, layout, rank))
    return list(found)


def _rank_boxes(entry: TensorEntry, layout: Layout, rank: int) -> list[Box]:
    c = layout.coords(rank)
    rule = rule_of(entry)
    boxes = model_parallel_boxes(entry, layout, c.tp_rank, c.ep_rank)
    if entry.role in ZERO_ROLES:
        if rule.expert_dim is not None:
            parts, part = layout.edp, c.edp_rank
        else:
            parts, part = layout.dp, c.dp_rank
        boxes = zero_part(boxes, rule.concat_dim, parts, part)
    return [b for b in boxes if not b.is_empty()]


@dataclass(frozen=True)
class Placement:
    """One distinct stored piece: its box and the rank that writes it (one writer even when replicated)."""

    box: Box
    writer: int


@dataclass(frozen=True)
class Geometry:
    """The distinct boxes of a tensor in a layout, in box order, with the ranks holding each.

    It depends on the tensor's shape, role and rule, not on its name, so tensors of the same structure (the same
    parameter in every layer) share one. The holders of box ``i`` are ``dp_rank * tp + tp_rank`` for ``dp_rank``
    in ``holders[i][1]`` and ``tp_rank`` in ``holders[i][0]`` (a product; sorted by rank, dp_rank major).
    """

    boxes: tuple[Box, ...]
    holders: tuple[tuple[Sequence[int], Sequence[int]], ...]
    tp: int

    def writer(self, i: int, seed: int) -> int:
        """The writer of box ``i`` for a tensor whose name hashes to ``seed`` (see :func:`placements`)."""
        tps, dps = self.holders[i]
        d, t = divmod((seed + i) % (len(tps) * len(dps)), len(tps))
        return dps[d] * self.tp + tps[t]


_CACHE: dict[tuple, tuple[Placement, ...]] = {}
_GEOMETRY: dict[tuple, Geometry] = {}


def name_seed(entry: TensorEntry) -> int:
    return zlib.crc32(entry.name.encode())


def geometry(entry: TensorEntry, layout: Layout) -> Geometry:
    """The (cached) :class:`Geometry` of ``entry`` in ``layout``."""
    key = (entry.shape, entry.role in ZERO_ROLES, entry.sharding_key, layout)
    found = _GEOMETRY.get(key)
    if found is None:
        if len(_GEOMETRY) > 10_000:
            _GEOMETRY.clear()
        found = _GEOMETRY[key] = _compute_geometry(entry, layout)
    return found


def placements(entry: TensorEntry, layout: Layout) -> list[Placement]:
    """Every distinct piece of ``entry`` in ``layout`` with its writer, in box order.

    Replicated pieces (parameters are replicated over data-parallel ranks, unsplit ones over TP ranks too) are
    written once; the writer rotates over the replicas with the piece index and the tensor name, so the write
    volume spreads evenly over the ranks.
    """
    if entry.mesh is not None:
        return [_placement(b, w) for b, w in mesh.entry_pieces(entry)]
    key = (entry.name, entry.shape, entry.role, entry.sharding_key, layout)
    cached = _CACHE.get(key)
    if cached is None:
        geo = geometry(entry, layout)
        seed = name_seed(entry)
        cached = tuple(_placement(b, geo.writer(i, seed)) for i, b in enumerate(geo.boxes))
        if len(_CACHE) > 20_000:
            _CACHE.clear()
        _CACHE[key] = cached
    return list(cached)


def _compute_geometry(entry: TensorEntry, layout: Layout) -> Geometry:
    """Distinct boxes with their holders, without visiting every rank.

    A rank's boxes depend only on a few of its coordinates: its TP rank (when the rule splits on TP), its EP rank
    (when the tensor has an expert dimension) and its ZeRO part (dp or edp rank, for optimizer roles). So we
    visit one representative per class of equivalent ranks; the holders of a box are then a product
    ``{dp_rank in D} x {tp_rank in T}``. This keeps a 1,024-rank layout at the cost of its distinct pieces, not
    of ``ranks x pieces``.
    """
    rule = rule_of(entry)
    tp, ep, dp = layout.tp, layout.ep, layout.dp
    tp_split = rule.tp is not None and tp > 1
    experts = rule.expert_dim is not None
    zero = entry.role in ZERO_ROLES
    concat = rule.concat_dim
    # (offsets, shape) -> (tp ranks holding it, dp ranks holding it), both sorted; plain tuples hash and sort in C.
    found: dict[tuple, tuple[Sequence[int], Sequence[int]]] = {}
    for tp_rank in range(tp) if tp_split else (0,):
        tps: Sequence[int] = (tp_rank,) if tp_split else range(tp)
        for ep_rank in range(ep) if experts else (0,):
            mp = model_parallel_boxes(entry, layout, tp_rank, ep_rank)
            if not zero:
                dps: Sequence[int] = range(ep_rank, dp, ep) if experts else range(dp)
                groups = [([(b.offsets, b.shape) for b in mp], dps)]
            elif experts:
                groups = _zero_groups(mp, concat, layout.edp, _expert_holders(ep, ep_rank))
            else:
                groups = _zero_groups(mp, concat, dp, lambda part: (part,))
            for boxes, dps in groups:
                for b in boxes:
                    if 0 in b[1]:
                        continue
                    if b in found:  # two classes share a box: not the product structure; count exactly instead
                        return _enumerate_geometry(entry, layout)
                    found[b] = (tps, dps)
    # Sorting (offsets, shape) tuples gives the same order as sorting Boxes (dataclass order compares fields).
    keys = sorted(found)
    return Geometry(tuple(Box.trusted(*k) for k in keys), tuple(found[k] for k in keys), tp)


_new = object.__new__
_set = object.__setattr__


def _placement(box: Box, writer: int) -> Placement:
    p = _new(Placement)
    _set(p, "box", box)
    _set(p, "writer", writer)
    return p


def _expert_holders(ep: int, ep_rank: int) -> Callable[[int], Sequence[int]]:
    """The dp rank holding ZeRO part ``part`` of expert rank ``ep_rank``'s tensor (``part`` is its edp rank)."""
    return lambda part: (part * ep + ep_rank,)


def _zero_groups(
    boxes: list[Box], concat_dim: int | None, parts: int, holders: Callable[[int], Sequence[int]]
) -> list[tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], Sequence[int]]]:
    """Every non-empty ZeRO part of a local tensor, as (offsets, shape) tuples, with its holders.

    The same boxes as :func:`zero_part` gives part by part, computed in one pass.
    """
    if not boxes or boxes[0].ndim == 0:
        return [([(b.offsets, b.shape) for b in boxes], holders(0))]
    if concat_dim == 0:
        spans, start = [], 0
        for b in boxes:
            spans.append((b, start, start + b.shape[0]))
            start += b.shape[0]
        rows = start
    else:
        rows = boxes[0].shape[0]
        spans = [(b, 0, rows) for b in boxes]
    if rows == 0:
        return []
    chunk = -(-rows // parts)
    out = []
    for part in range(min(parts, -(-rows // chunk))):
        lo, hi = part * chunk, min((part + 1) * chunk, rows)
        got = []
        for b, b_lo, b_hi in spans:
            r0, r1 = max(lo, b_lo), min(hi, b_hi)
            if r1 > r0:
                got.append(((b.offsets[0] + r0 - b_lo,) + b.offsets[1:], (r1 - r0,) + b.shape[1:]))
        out.append((got, holders(part)))
    return out


def _enumerate_geometry(entry: TensorEntry, layout: Layout) -> Geometry:
    """The reference definition: visit every rank. Used when the fast path finds no product structure."""
    holders: dict[Box, list[int]] = {}
    for rank in range(layout.world):
        for b in rank_boxes(entry, layout, rank):
            holders.setdefault(b, []).append(rank)
    boxes = sorted(holders)
    # tp=1 in the Geometry makes writer() index the explicit rank list directly.
    return Geometry(tuple(boxes), tuple((tuple(holders[b]), (0,)) for b in boxes), 1)


def _enumerate_placements(entry: TensorEntry, layout: Layout) -> tuple[Placement, ...]:
    """Placements by the rank-by-rank definition (tests pin the fast path against it)."""
    geo = _enumerate_geometry(entry, layout)
    seed = name_seed(entry)
    return tuple(Placement(b, geo.writer(i, seed)) for i, b in enumerate(geo.boxes))


def _compute_placements(entry: TensorEntry, layout: Layout) -> tuple[Placement, ...]:
    """Placements through the fast geometry (uncached)."""
    geo = _compute_geometry(entry, layout)
    seed = name_seed(entry)
    return tuple(Placement(b, geo.writer(i, seed)) for i, b in enumerate(geo.boxes))


def pieces_written_by(entry: TensorEntry, layout: Layout, rank: int) -> list[Box]:
    """The boxes of ``entry`` that ``rank`` writes when saving in ``layout``."""
    return [p.box for p in placements(entry, layout) if p.writer == rank]
