"""The pure reshard planner: which stored source bytes feed which target box, and how many bytes each rank reads.

No processes, no I/O: a plan (the values of :mod:`.plan`) is built from a source
:class:`~moeckpt.formats.index.Index` (its layout and sharding rules locate every stored piece and its writer, see
:func:`~.plan.source_pieces`) and a target :class:`~moeckpt.reshard.layout.Layout`. Two kinds of plan share the
same values:

* :func:`plan_reshard` (offline): one :class:`~.plan.RankPlan` per target *writer*, listing the distinct pieces it
  writes (each stored once, replicated ones by a single writer);
* :func:`plan_load` (load time): one :class:`~.plan.RankPlan` per target *rank*, listing the boxes of its local
  tensors in the order they concatenate along the TP dim (:func:`plan_boxes`: explicit boxes per rank).

Reads are whole rows of a stored piece (its dim 0), because pieces are stored row-major and checksummed in blocks;
executors share row reads between items, so the byte figures here count each source row once per plan
(:attr:`~.plan.RankPlan.read_nbytes`). Which source boxes a target box meets comes from :mod:`.source_lookup`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index, TensorEntry

from .layout import Layout
from .placement import geometry, name_seed, placements, rank_boxes
from .plan import RankPlan, ReadItem, ReshardPlan, SourcePiece, TargetPiece, source_layout
from .runtime import paused_gc
from .source_lookup import Cover, SourceTensors, fixed_writers, union_elems
from .tensors import check_layout


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
    with paused_gc():
        return _plan_writers(index, target, targets, sources)


def _plan_writers(
    index: Index,
    target: Layout,
    targets: Mapping[str, Sequence[tuple[Box, int]]] | None,
    sources: Mapping[str, Sequence[SourcePiece]] | None,
) -> ReshardPlan:
    """:func:`plan_reshard`'s work, tensor by tensor: the reads of every box of one tensor come from one lookup,
    and a target geometry's boxes meet the same source boxes in every tensor of its structure."""
    layout = source_layout(index)
    tensors = SourceTensors(index, layout, sources)
    pieces: dict[int, list[TargetPiece]] = {w: [] for w in range(target.world)}
    need: dict[int, int] = dict.fromkeys(pieces, 0)
    read: dict[int, int] = dict.fromkeys(pieces, 0)
    covers: dict[tuple[int, int], list[Cover | None]] = {}
    fixed: dict[int, list[int]] = {}
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        t = tensors.of(entry)
        lookup, itemsize = t.lookup, t.itemsize
        if targets is not None and name in targets:
            given: Sequence[tuple[Box, int]] = targets[name]
            memo: list[Cover | None] | None = None
        elif entry.mesh is not None:
            given = [(p.box, p.writer) for p in placements(entry, target)]
            memo = None
        else:
            geo, seed = geometry(entry, target), name_seed(entry)
            ws = fixed.get(id(geo))
            if ws is None:
                ws = fixed[id(geo)] = fixed_writers(geo)
            given = [(box, w if w >= 0 else geo.writer(i, seed)) for i, (box, w) in enumerate(zip(geo.boxes, ws))]
            memo = covers.get((id(lookup), id(geo)))
            if memo is None:
                memo = covers[(id(lookup), id(geo))] = [None] * len(geo.boxes)
        first: dict[int, Cover] = {}
        again: dict[int, list[Cover]] = {}
        for i, (box, writer) in enumerate(given):
            cover = None if memo is None else memo[i]
            if cover is None:
                cover = lookup.cover(entry, box)
                if memo is not None:
                    memo[i] = cover
            if writer not in pieces:
                pieces[writer], need[writer], read[writer] = [], 0, 0
            pieces[writer].append(_target_piece(name, box, t.reads(cover, box)))
            need[writer] += cover.numel * itemsize
            if writer in first:
                again.setdefault(writer, [first[writer]]).append(cover)
            else:
                first[writer] = cover
                read[writer] += cover.read_elems * itemsize
        for writer, more in again.items():  # a source row read for two boxes of one tensor counts once
            read[writer] += (union_elems(more) - more[0].read_elems) * itemsize
    ranks = tuple(RankPlan(w, tuple(pieces[w]), need[w], read[w]) for w in sorted(pieces))
    return ReshardPlan(layout, target, "reshard", ranks)


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
    with paused_gc():
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
    with paused_gc():
        return _plan(index, source_layout(index), "load", per_rank, sources)


def _plan(
    index: Index,
    target: Layout,
    kind: str,
    wanted: dict[int, list[tuple[TensorEntry, Box]]],
    sources: Mapping[str, Sequence[SourcePiece]] | None,
) -> ReshardPlan:
    layout = source_layout(index)
    tensors = SourceTensors(index, layout, sources)
    # A load plan holds each replicated box on many ranks: one TargetPiece value serves them all.
    shared: dict[tuple, TargetPiece] | None = {} if kind == "load" else None
    ranks = []
    for rank, boxes in wanted.items():
        out = []
        need = read = 0
        first: dict[str, Cover] = {}
        again: dict[str, list[Cover]] = {}
        for entry, box in boxes:
            t = tensors.of(entry)
            cover = t.lookup.cover(entry, box)
            key = (t.name, box.offsets, box.shape)
            known = None if shared is None else shared.get(key)
            if known is None:
                known = _target_piece(t.name, box, t.reads(cover, box))
                if shared is not None:
                    shared[key] = known
            out.append(known)
            need += cover.numel * t.itemsize
            if t.name in first:
                again.setdefault(t.name, [first[t.name]]).append(cover)
            else:
                first[t.name] = cover
                read += cover.read_elems * t.itemsize
        for name, covers in again.items():  # a source row read for two boxes of one tensor counts once
            itemsize = tensors.by_name[name].itemsize
            read += (union_elems(covers) - covers[0].read_elems) * itemsize
        ranks.append(RankPlan(rank, tuple(out), need, read))
    return ReshardPlan(layout, target, kind, tuple(ranks))


def _target_piece(tensor: str, box: Box, reads: tuple[ReadItem, ...]) -> TargetPiece:
    """A TargetPiece built in C (``tuple.__new__``), without the named tuple's Python-level ``__new__``."""
    return tuple.__new__(TargetPiece, (tensor, box, reads))
