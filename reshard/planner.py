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
from itertools import accumulate, repeat

import numpy as np

from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index, TensorEntry

from .layout import Layout
from .placement import Geometry, geometry, name_seed, placements, rank_boxes
from .plan import RankPlan, ReadItem, ReshardPlan, SourcePiece, TargetPiece, source_layout
from .runtime import paused_gc
from .source_lookup import Cover, Rotation, SourceLookup, SourceTensor, SourceTensors, union_elems
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
    """:func:`plan_reshard`'s work, tensor by tensor (in name order, the order of every writer's pieces): a
    tensor placed by a layout rule is built from its structure's :class:`_Structure`, any other box by box."""
    layout = source_layout(index)
    tensors = SourceTensors(index, layout, sources)
    pieces: dict[int, list[TargetPiece]] = {w: [] for w in range(target.world)}
    need: dict[int, int] = dict.fromkeys(pieces, 0)
    read: dict[int, int] = dict.fromkeys(pieces, 0)
    structures: dict[tuple[int, int], _Structure] = {}
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        t = tensors.of(entry)
        if (targets is None or name not in targets) and entry.mesh is None:
            geo = geometry(entry, target)
            st = structures.get((id(t.lookup), id(geo)))
            if st is None:
                st = structures[(id(t.lookup), id(geo))] = _Structure(entry, t.lookup, geo)
            st.add(t, name_seed(entry), pieces)
            continue
        if targets is not None and name in targets:
            given: Sequence[tuple[Box, int]] = targets[name]
        else:
            given = [(p.box, p.writer) for p in placements(entry, target)]
        _add_boxes(entry, t, given, pieces, need, read)
    for st in structures.values():
        st.count(need, read)
    ranks = tuple(RankPlan(w, tuple(pieces[w]), need[w], read[w]) for w in sorted(pieces))
    return ReshardPlan(layout, target, "reshard", ranks)


def _add_boxes(
    entry: TensorEntry,
    t: SourceTensor,
    given: Sequence[tuple[Box, int]],
    pieces: dict[int, list[TargetPiece]],
    need: dict[int, int],
    read: dict[int, int],
) -> None:
    """The pieces of one tensor's ``(box, writer)`` list, appended to their writers', with their bytes."""
    covers: dict[int, list[Cover]] = {}
    for box, writer in given:
        cover = t.lookup.cover(entry, box)
        if writer not in pieces:
            pieces[writer], need[writer], read[writer] = [], 0, 0
        pieces[writer].append(_target_piece(t.name, box, t.reads(cover, box)))
        need[writer] += cover.numel * t.itemsize
        covers.setdefault(writer, []).append(cover)
    for writer, more in covers.items():  # a source row read for two boxes of one tensor counts once
        read[writer] += union_elems(more) * t.itemsize


class _Structure:
    """The tensors of one structure (one source lookup, one target geometry): every tensor's boxes meet the same
    source boxes, so the covers and the read items' boxes are laid out once, and a tensor's pieces are built from
    them in C (``map`` over ``tuple.__new__``). Its bytes are counted for all its tensors at once
    (:meth:`count`): only the writers of replicated boxes differ between them, rotating with the name."""

    def __init__(self, entry: TensorEntry, lookup: SourceLookup, geo: Geometry):
        self.boxes = geo.boxes
        self.covers = [lookup.cover(entry, box) for box in geo.boxes]
        hits = [(k, src, region, box) for box, c in zip(geo.boxes, self.covers) for k, src, region in c.hits]
        #: per read item of a tensor: its source position, source box, region and target box.
        self.src_k = [h[0] for h in hits]
        self.src = [h[1] for h in hits]
        self.regions = [h[2] for h in hits]
        self.target_boxes = [h[3] for h in hits]
        #: per box: the slice of the read items that fill it.
        ends = list(accumulate(len(c.hits) for c in self.covers))
        self.slices = [slice(a, b) for a, b in zip([0] + ends, ends)]
        known = lookup.writers if lookup.writers is not None else lookup.fixed
        #: the source writer of each read item where one rank holds its piece, else -1 (those rotate with the name).
        self.src_writers = [known[k] for k in self.src_k]
        self.rotating_src = [j for j, w in enumerate(self.src_writers) if w < 0]
        self.writers = Rotation(geo)
        self.numel = np.array([c.numel for c in self.covers], dtype=np.int64)
        self.read_elems = np.array([c.read_elems for c in self.covers], dtype=np.int64)
        #: per tensor added: its writers (one per box) and item size.
        self.added: list[tuple[np.ndarray, int]] = []

    def add(self, t: SourceTensor, seed: int, pieces: dict[int, list[TargetPiece]]) -> None:
        """Append tensor ``t``'s pieces (its name hashes to ``seed``) to the pieces of their writers."""
        row = self.writers.of(seed)
        self.added.append((row, t.itemsize))
        src_writers = self.src_writers
        if self.rotating_src:
            src_writers = list(src_writers)
            for j in self.rotating_src:
                src_writers[j] = t.writer(self.src_k[j])
        name = repeat(t.name)
        items = list(map(_tuple, repeat(ReadItem), zip(name, self.src, src_writers, self.regions, self.target_boxes)))
        reads = map(tuple, map(items.__getitem__, self.slices))
        for w, piece in zip(row.tolist(), map(_tuple, repeat(TargetPiece), zip(name, self.boxes, reads))):
            pieces[w].append(piece)

    def count(self, need: dict[int, int], read: dict[int, int]) -> None:
        """Add the bytes every tensor added needs and reads to its writers' (``need`` and ``read`` by writer)."""
        if not self.added or not self.boxes:
            return
        rows = np.stack([row for row, _ in self.added])
        world = int(rows.max()) + 1
        sizes = np.array([size for _, size in self.added], dtype=np.int64)[:, None]
        need_w, read_w = np.zeros(world, np.int64), np.zeros(world, np.int64)
        np.add.at(need_w, rows, sizes * self.numel)
        ordered = np.sort(rows, axis=1)
        twice = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)  # a writer of two boxes of one tensor
        np.add.at(read_w, rows[~twice], (sizes * self.read_elems)[~twice])
        for i in np.flatnonzero(twice).tolist():  # a source row read for two boxes of one tensor counts once
            by_writer: dict[int, list[Cover]] = {}
            for w, c in zip(rows[i].tolist(), self.covers):
                by_writer.setdefault(w, []).append(c)
            for w, covers in by_writer.items():
                read_w[w] += union_elems(covers) * self.added[i][1]
        for w in np.flatnonzero(need_w | read_w).tolist():
            need[w] += int(need_w[w])
            read[w] += int(read_w[w])


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


_tuple = tuple.__new__


def _target_piece(tensor: str, box: Box, reads: tuple[ReadItem, ...]) -> TargetPiece:
    """A TargetPiece built in C (``tuple.__new__``), without the named tuple's Python-level ``__new__``."""
    return _tuple(TargetPiece, (tensor, box, reads))
