"""The planner as it was before the 1,024-rank speed-up (issue 21), kept as the reference the fast one must equal.

Only the algorithm: the plan's value types are the library's, so plans compare with ``==``.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import Geometry, geometry, is_stored, name_seed, placements, rank_boxes
from moeckpt.reshard.plan import (
    RankPlan,
    ReadItem,
    ReshardPlan,
    SourcePiece,
    TargetPiece,
    source_layout,
    source_pieces,
)
from moeckpt.reshard.tensors import check_layout


def plan_reshard(
    index: Index,
    target: Layout,
    *,
    sources: Mapping[str, Sequence[SourcePiece]] | None = None,
    targets: Mapping[str, Sequence[tuple[Box, int]]] | None = None,
) -> ReshardPlan:
    """The offline plan: every distinct piece of ``target``, grouped by the writer that stores it.

    ``index`` describes the checkpoint to write: its tensors' shardings place the pieces (a layout rule in
    ``target``, or a device mesh), except for tensors in ``targets``, whose ``(box, writer)`` pieces are given
    (stored-piece shardings: a DCP checkpoint's chunks kept as they are)."""
    check_layout(index.tensors, target)
    per_writer: dict[int, list[tuple[TensorEntry, Box]]] = {w: [] for w in range(target.world)}
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        if targets is not None and name in targets:
            given = targets[name]
        elif entry.mesh is not None:
            given = [(p.box, p.writer) for p in placements(entry, target)]
        else:
            geo, seed = geometry(entry, target), name_seed(entry)
            given = [(box, geo.writer(i, seed)) for i, box in enumerate(geo.boxes)]
        for box, writer in given:
            per_writer.setdefault(writer, []).append((entry, box))
    return _plan(index, target, "reshard", dict(sorted(per_writer.items())), sources)


def plan_load(
    index: Index,
    target: Layout,
    ranks: Iterable[int],
    *,
    tensors: Iterable[str] | None = None,
    sources: Mapping[str, Sequence[SourcePiece]] | None = None,
) -> ReshardPlan:
    """The load-time plan: for each of ``ranks``, the boxes of its local tensors (of ``tensors``, default all)."""
    check_layout(index.tensors, target)
    names = sorted(index.tensors if tensors is None else tensors)
    for name in names:
        if name not in index.tensors:
            raise CheckpointIndexError(f"no tensor named {name!r} in the checkpoint; it holds {len(index.tensors)}")
    per_rank = {
        r: [(index.tensors[n], b) for n in names for b in rank_boxes(index.tensors[n], target, r)] for r in ranks
    }
    return _plan(index, target, "load", per_rank, sources)


def plan_boxes(
    index: Index,
    wanted: Mapping[int, Sequence[tuple[str, Box]]],
    *,
    sources: Mapping[str, Sequence[SourcePiece]] | None = None,
) -> ReshardPlan:
    """The load plan of explicit boxes: for each rank, ``(tensor name, box)`` pairs in global coordinates (a library
    state dict's local tensors, whatever mesh holds them), each covered by the checkpoint's stored pieces.
    ``sources`` gives the stored pieces of tensors no rule locates (stored zarr cells, DCP-written pieces)."""
    per_rank: dict[int, list[tuple[TensorEntry, Box]]] = {}
    for rank, items in wanted.items():
        out = []
        for name, box in items:
            entry = index.tensors.get(name)
            if entry is None:
                raise CheckpointIndexError(f"no tensor named {name!r} in the checkpoint; it holds {len(index.tensors)}")
            if not box.within(entry.shape):
                raise CheckpointIndexError(
                    f"tensor {name!r}: box {box.to_json()} lies outside its shape {list(entry.shape)}"
                )
            out.append((entry, box))
        per_rank[rank] = out
    return _plan(index, source_layout(index), "load", per_rank, sources)


def _plan(
    index: Index,
    target: Layout,
    kind: str,
    wanted: dict[int, list[tuple[TensorEntry, Box]]],
    sources: Mapping[str, Sequence[SourcePiece]] | None,
) -> ReshardPlan:
    lookups: dict[object, _Lookup] = {}
    layout = source_layout(index)

    by_name: dict[str, _Lookup] = {}

    def lookup(entry: TensorEntry) -> _Lookup:
        found = by_name.get(entry.name)
        if found is not None:
            return found
        if sources is not None and (entry.name in sources or is_stored(entry)):
            found = _Lookup.of_pieces(sources.get(entry.name, ()))
        elif entry.mesh is not None:  # a device-mesh sharding: its stored boxes and writers come from the mesh
            found = _Lookup.of_pieces(source_pieces(index, [entry.name])[entry.name])
        else:
            # From the index alone: tensors of one structure share the source geometry and its sorted lookup.
            geo = geometry(entry, layout)
            found = lookups.get(id(geo))
            if found is None:
                found = lookups[id(geo)] = _Lookup.of_geometry(geo)
        by_name[entry.name] = found
        return found

    ranks = []
    for rank, boxes in wanted.items():
        out = []
        need = 0
        rows_read: dict[tuple, list[tuple[int, int]]] = {}
        for entry, box in boxes:
            item_bytes = dtypes.itemsize(entry.dtype)
            reads = lookup(entry).cover(entry, box)
            out.append(TargetPiece(entry.name, box, reads))
            need += box.numel * item_bytes
            for r in reads:
                rows_read.setdefault((r.tensor, r.src_box), []).append(r.rows)
        read = 0
        for (tensor, src), spans in rows_read.items():
            row_elems = (src.numel // src.shape[0]) if src.ndim and src.shape[0] else src.numel
            read += _union_length(spans) * row_elems * dtypes.itemsize(index.tensors[tensor].dtype)
        ranks.append(RankPlan(rank, tuple(out), need, read))
    return ReshardPlan(source_layout(index), target, kind, tuple(ranks))


class _Lookup:
    """Source boxes of one tensor (or tensor structure) sorted by box order, to find those a box overlaps quickly."""

    def __init__(self, boxes: Sequence[Box], writers: Sequence[int] | None, geo: Geometry | None):
        self.boxes = boxes
        self.writers = writers
        self.geo = geo
        self.starts = [b.offsets[0] if b.ndim else 0 for b in boxes]
        self.span = max((b.shape[0] if b.ndim else 1 for b in boxes), default=0)
        self._memo: dict[Box, tuple[tuple[int, Box], ...]] = {}
        self._seeds: dict[str, int] = {}

    def _seed(self, name: str) -> int:
        seed = self._seeds.get(name)
        if seed is None:
            seed = self._seeds[name] = zlib.crc32(name.encode())
        return seed

    @classmethod
    def of_pieces(cls, pieces: Sequence[SourcePiece]) -> _Lookup:
        ordered = sorted(pieces, key=lambda p: (p.box.offsets, p.box.shape))
        return cls([p.box for p in ordered], [p.writer for p in ordered], None)

    @classmethod
    def of_geometry(cls, geo: Geometry) -> _Lookup:
        return cls(geo.boxes, None, geo)

    def cover(self, entry: TensorEntry, box: Box) -> tuple[ReadItem, ...]:
        hits = self._memo.get(box)
        if hits is None:
            hits = self._memo[box] = self._overlaps(box)
            filled = sum(region.numel for _, region in hits)
        else:
            filled = box.numel  # checked when first memoised
        if filled != box.numel:
            raise CheckpointIndexError(
                f"tensor {entry.name!r}: the source pieces cover {filled} of the {box.numel} elements of box "
                f"{box.to_json()}; the checkpoint's files do not match its index (run `moeckpt verify`)"
            )
        if self.writers is not None:
            return tuple(ReadItem(entry.name, self.boxes[k], self.writers[k], r, box) for k, r in hits)
        seed, geo = self._seed(entry.name), cast(Geometry, self.geo)  # of_geometry: no writers, a geometry
        return tuple(ReadItem(entry.name, self.boxes[k], geo.writer(k, seed), r, box) for k, r in hits)

    def _overlaps(self, box: Box) -> tuple[tuple[int, Box], ...]:
        """(source position, overlap) of every source box overlapping ``box``; shared by same-structure tensors."""
        if box.ndim:
            lo, hi = box.offsets[0], box.offsets[0] + box.shape[0]
        else:
            lo, hi = 0, 1
        i = bisect.bisect_left(self.starts, lo - self.span + 1)
        j = bisect.bisect_left(self.starts, hi)
        out = []
        for k in range(i, j):
            region = self.boxes[k].intersect(box) if box.ndim else self.boxes[k]
            if region is not None:
                out.append((k, region))
        return tuple(out)


def _union_length(spans: list[tuple[int, int]]) -> int:
    total = 0
    end = None
    for a, b in sorted(spans):
        if end is None or a >= end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def plan_exchange(index: Index, plan: ReshardPlan, chunk_bytes: int, round_bytes: int):
    """The collective load's exchange plan as ``reshard/load.py`` computed it inline: (units, owner, rounds)."""
    from moeckpt.reshard.chunks import chunk_rows

    size = len(plan.ranks)
    units: dict[tuple, list[tuple[int, int, Box]]] = {}
    unit_bytes: dict[tuple, int] = {}
    for g, rank_plan in enumerate(plan.ranks):
        for pos, piece in enumerate(rank_plan.pieces):
            entry = index.tensors[piece.tensor]
            item_bytes = dtypes.itemsize(entry.dtype)
            for item in piece.reads:
                src = item.src_box
                per = chunk_rows(src, entry.dtype, chunk_bytes)
                r0, r1 = item.rows
                for c in range(r0 // per, (r1 - 1) // per + 1):
                    lo, hi = c * per, min((c + 1) * per, src.shape[0] if src.ndim else 1)
                    if src.ndim:
                        rows_box = Box((src.offsets[0] + lo,) + src.offsets[1:], (hi - lo,) + src.shape[1:])
                        sub = item.region.intersect(rows_box)
                    else:
                        sub = item.region
                    if sub is None:
                        continue
                    key = (item.tensor, src.offsets, src.shape, item.writer, c)
                    if key not in units:
                        units[key] = []
                        unit_bytes[key] = (
                            (hi - lo) * (src.numel // max(1, src.shape[0]) if src.ndim else 1) * item_bytes
                        )
                    units[key].append((g, pos, sub))
    order = sorted(units)
    load = [0] * size
    owner: dict[tuple, int] = {}
    for key in order:
        needers = sorted({g for g, _, _ in units[key]})
        pick = min(needers, key=lambda g: (load[g], (g - zlib.crc32(repr(key).encode())) % size))
        owner[key] = pick
        load[pick] += unit_bytes[key]
    rounds: list[list[tuple]] = [[]]
    round_load = [0] * size
    for key in order:
        o = owner[key]
        if rounds[-1] and round_load[o] + unit_bytes[key] > round_bytes:
            rounds.append([])
            round_load = [0] * size
        rounds[-1].append(key)
        round_load[o] += unit_bytes[key]
    return units, owner, rounds
