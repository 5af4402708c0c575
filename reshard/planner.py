"""The pure reshard planner: which stored source bytes feed which target box, and how many bytes each rank reads.

No processes, no I/O: a plan is a value built from a source :class:`~moeckpt.formats.index.Index` (its layout and
sharding rules locate every stored piece and its writer, see :func:`source_pieces`) and a target
:class:`~moeckpt.reshard.layout.Layout`. Two kinds of plan share the same values:

* :func:`plan_reshard` (offline): one :class:`RankPlan` per target *writer*, listing the distinct pieces it writes
  (each stored once, replicated ones by a single writer);
* :func:`plan_load` (load time): one :class:`RankPlan` per target *rank*, listing the boxes of its local tensors in
  the order they concatenate along the TP dim.

Every :class:`ReadItem` names a source piece, the rows of it to read, and the region (global coordinates) that
lands in a target box. Reads are whole rows of a stored piece (its dim 0), because pieces are stored row-major
and checksummed in blocks; executors share row reads between items, so the byte figures here count each
source row once per plan (:attr:`RankPlan.read_nbytes`).

The planner works on :class:`SourcePiece` values, not on files: a safetensors writer is a file, a zarr writer a
set of chunks; either backend lists the stored pieces of a writer, so one plan serves both.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index, TensorEntry

from .layout import Layout
from .mesh import MeshGeometry, entry_placements, mesh_geometry
from .placement import Geometry, geometry, is_stored, name_seed, placements, rank_boxes
from .runtime import paused_gc
from .tensors import check_layout


@dataclass(frozen=True)
class SourcePiece:
    """A stored piece of the source checkpoint: a box of a tensor and the writer whose file (or chunks) hold it."""

    tensor: str
    box: Box
    writer: int


@dataclass(frozen=True)
class ReadItem:
    """Copy ``region`` (global coordinates) of ``tensor`` from a stored source piece into a target box."""

    tensor: str
    #: the stored piece read from, and its writer.
    src_box: Box
    writer: int
    #: the elements copied, in global coordinates: ``src_box ∩ target_box``.
    region: Box
    #: the target box the region lands in.
    target_box: Box

    @property
    def source(self) -> SourcePiece:
        return SourcePiece(self.tensor, self.src_box, self.writer)

    @property
    def rows(self) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of the stored piece (its dim 0, piece coordinates) that hold the region."""
        if not self.src_box.ndim:
            return (0, 1)
        r0 = self.region.offsets[0] - self.src_box.offsets[0]
        return (r0, r0 + self.region.shape[0])


@dataclass(frozen=True)
class TargetPiece:
    """One box a target rank holds (load) or writes (offline), with the reads that fill it exactly."""

    tensor: str
    box: Box
    reads: tuple[ReadItem, ...]


@dataclass(frozen=True)
class RankPlan:
    """What one target rank (load) or writer (offline) needs and reads."""

    rank: int
    pieces: tuple[TargetPiece, ...]
    #: bytes of the target boxes (what the rank needs).
    nbytes: int
    #: bytes of source rows read, each stored row counted once (what a rank reading alone fetches).
    read_nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    """A whole plan: the source and target layouts and one :class:`RankPlan` per planned rank or writer."""

    source: Layout
    target: Layout
    #: ``"reshard"`` (pieces each target writer stores) or ``"load"`` (boxes each target rank holds).
    kind: str
    ranks: tuple[RankPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    @property
    def read_nbytes(self) -> int:
        """Source bytes read if every planned rank reads its own rows (no sharing between ranks)."""
        return sum(r.read_nbytes for r in self.ranks)

    def rank(self, rank: int) -> RankPlan:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} is not in this plan (planned: {[r.rank for r in self.ranks][:8]}...)")


def source_layout(index: Index) -> Layout:
    return Layout.from_json(index.layout)


def source_pieces(index: Index, tensors: Iterable[str] | None = None) -> dict[str, list[SourcePiece]]:
    """Every stored piece of the source, located from the index alone (layout + sharding rules)."""
    layout = source_layout(index)
    names = index.tensors if tensors is None else tensors
    return {
        name: [SourcePiece(name, p.box, p.writer) for p in placements(index.tensors[name], layout)] for name in names
    }


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
    tensors = _Tensors(index, layout, sources)
    pieces: dict[int, list[TargetPiece]] = {w: [] for w in range(target.world)}
    need: dict[int, int] = dict.fromkeys(pieces, 0)
    read: dict[int, int] = dict.fromkeys(pieces, 0)
    covers: dict[tuple[int, int], list[_Cover | None]] = {}
    fixed: dict[int, list[int]] = {}
    for name in sorted(index.tensors):
        entry = index.tensors[name]
        t = tensors.of(entry)
        lookup, itemsize = t.lookup, t.itemsize
        if targets is not None and name in targets:
            given: Sequence[tuple[Box, int]] = targets[name]
            memo: list[_Cover | None] | None = None
        elif entry.mesh is not None:
            given = [(p.box, p.writer) for p in placements(entry, target)]
            memo = None
        else:
            geo, seed = geometry(entry, target), name_seed(entry)
            ws = fixed.get(id(geo))
            if ws is None:
                ws = fixed[id(geo)] = _fixed_writers(geo)
            given = [(box, w if w >= 0 else geo.writer(i, seed)) for i, (box, w) in enumerate(zip(geo.boxes, ws))]
            memo = covers.get((id(lookup), id(geo)))
            if memo is None:
                memo = covers[(id(lookup), id(geo))] = [None] * len(geo.boxes)
        first: dict[int, _Cover] = {}
        again: dict[int, list[_Cover]] = {}
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
            read[writer] += (_union_elems(more) - more[0].read_elems) * itemsize
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
    tensors = _Tensors(index, layout, sources)
    # A load plan holds each replicated box on many ranks: one TargetPiece value serves them all.
    shared: dict[tuple, TargetPiece] | None = {} if kind == "load" else None
    ranks = []
    for rank, boxes in wanted.items():
        out = []
        need = read = 0
        first: dict[str, _Cover] = {}
        again: dict[str, list[_Cover]] = {}
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
            read += (_union_elems(covers) - covers[0].read_elems) * itemsize
        ranks.append(RankPlan(rank, tuple(out), need, read))
    return ReshardPlan(layout, target, kind, tuple(ranks))


_new = object.__new__
_set = object.__setattr__


def _target_piece(tensor: str, box: Box, reads: tuple[ReadItem, ...]) -> TargetPiece:
    """A TargetPiece without the frozen dataclass's per-field ``__setattr__`` (a plan at 1,024 ranks builds
    millions; the values are the same as the constructor's)."""
    p = _new(TargetPiece)
    _set(p, "__dict__", {"tensor": tensor, "box": box, "reads": reads})
    return p


class _Cover:
    """The source boxes one target box overlaps, shared by every tensor of the same structure (its reads differ
    only by the tensor's name and the writers its name picks)."""

    __slots__ = ("hits", "numel", "read_elems", "spans")

    def __init__(self, hits: tuple[tuple[int, Box, Box], ...], numel: int):
        #: (source position, source box, overlap) per source box the target box meets.
        self.hits = hits
        self.numel = numel
        #: per source box: (its (offsets, shape), rows ``[r0, r1)`` read, elements per row).
        self.spans = tuple((_key(src), _rows(src, region), _row_elems(src)) for _, src, region in hits)
        self.read_elems = _union_elems([self])


def _key(box: Box) -> tuple:
    return (box.offsets, box.shape)


def _rows(src: Box, region: Box) -> tuple[int, int]:
    if not src.ndim:
        return (0, 1)
    r0 = region.offsets[0] - src.offsets[0]
    return (r0, r0 + region.shape[0])


def _row_elems(src: Box) -> int:
    return (src.numel // src.shape[0]) if src.ndim and src.shape[0] else src.numel


def _union_elems(covers: Sequence[_Cover]) -> int:
    """Elements of the source rows ``covers`` read, each stored row counted once."""
    if len(covers) == 1 and len(covers[0].spans) <= 1:
        return sum((r1 - r0) * per for _, (r0, r1), per in covers[0].spans)
    spans: dict[tuple, list[tuple[int, int]]] = {}
    per_row: dict[tuple, int] = {}
    for c in covers:
        for key, rows, per in c.spans:
            spans.setdefault(key, []).append(rows)
            per_row[key] = per
    return sum(_union_length(rows) * per_row[key] for key, rows in spans.items())


class _Tensor:
    """One source tensor as the planner reads it: its lookup, item size, name seed and source writers."""

    __slots__ = ("name", "lookup", "itemsize", "seed", "_writers")

    def __init__(self, name: str, lookup: _Lookup, itemsize: int):
        self.name, self.lookup, self.itemsize = name, lookup, itemsize
        self.seed = zlib.crc32(name.encode())
        self._writers: dict[int, int] = {}

    def writer(self, k: int) -> int:
        """The writer of source box ``k`` (a geometry's replicated boxes rotate their writer by the name)."""
        lk = self.lookup
        if lk.writers is not None:
            return lk.writers[k]
        w = lk.fixed[k]
        if w < 0:
            w = self._writers.get(k, -1)
            if w < 0:
                w = self._writers[k] = cast("Geometry | _MeshWriters", lk.geo).writer(k, self.seed)
        return w

    def reads(self, cover: _Cover, box: Box) -> tuple[ReadItem, ...]:
        """The read items of ``box`` from the source boxes ``cover`` lists, built without the frozen dataclass's
        per-field ``__setattr__`` (the values are the constructor's): an offline plan at 1,024 ranks makes
        millions."""
        name, lk = self.name, self.lookup
        known = lk.writers if lk.writers is not None else lk.fixed
        out = []
        for k, src, region in cover.hits:
            w = known[k]
            if w < 0:
                w = self.writer(k)
            r = _new(ReadItem)
            _set(r, "__dict__", {"tensor": name, "src_box": src, "writer": w, "region": region, "target_box": box})
            out.append(r)
        return tuple(out)


class _Tensors:
    """Per-name :class:`_Tensor` values; tensors of one structure share the source geometry's lookup."""

    def __init__(self, index: Index, layout: Layout, sources: Mapping[str, Sequence[SourcePiece]] | None):
        self.index, self.layout, self.sources = index, layout, sources
        self.by_name: dict[str, _Tensor] = {}
        self._lookups: dict[int, _Lookup] = {}
        self._mesh_lookups: dict[tuple, _Lookup] = {}

    def of(self, entry: TensorEntry) -> _Tensor:
        found = self.by_name.get(entry.name)
        if found is None:
            found = self.by_name[entry.name] = _Tensor(entry.name, self._lookup(entry), dtypes.itemsize(entry.dtype))
        return found

    def _lookup(self, entry: TensorEntry) -> _Lookup:
        sources = self.sources
        if sources is not None and (entry.name in sources or is_stored(entry)):
            return _Lookup.of_pieces(sources.get(entry.name, ()))
        if entry.mesh is not None:
            # A device-mesh sharding: tensors of one structure on one mesh share its boxes and their covers (every
            # layer's weights); only a replicated box's writer differs, rotating with the tensor's name.
            mesh = entry.mesh
            geo_m = mesh_geometry(entry.shape, mesh.shape, entry_placements(entry))
            key = (id(geo_m), tuple(mesh.ranks))
            found = self._mesh_lookups.get(key)
            if found is None:
                found = self._mesh_lookups[key] = _Lookup.of_mesh(geo_m, mesh.ranks)
            return found
        # From the index alone: tensors of one structure share the source geometry and its sorted lookup.
        geo = geometry(entry, self.layout)
        found = self._lookups.get(id(geo))
        if found is None:
            found = self._lookups[id(geo)] = _Lookup.of_geometry(geo)
        return found


class _Lookup:
    """Source boxes of one tensor (or tensor structure) sorted by box order, to find those a box overlaps quickly."""

    def __init__(
        self,
        boxes: Sequence[Box],
        writers: Sequence[int] | None,
        geo: Geometry | _MeshWriters | None,
        fixed: list[int] | None = None,
    ):
        self.boxes = boxes
        self.writers = writers
        self.geo = geo
        self.starts = [b.offsets[0] if b.ndim else 0 for b in boxes]
        self.span = max((b.shape[0] if b.ndim else 1 for b in boxes), default=0)
        #: a geometry box's writer when one rank holds it (ZeRO parts: the same for every tensor), else -1.
        if fixed is None:
            fixed = [] if not isinstance(geo, Geometry) else _fixed_writers(geo)
        self.fixed = fixed
        self._memo: dict[tuple, _Cover] = {}

    @classmethod
    def of_pieces(cls, pieces: Sequence[SourcePiece]) -> _Lookup:
        ordered = sorted(pieces, key=lambda p: (p.box.offsets, p.box.shape))
        return cls([p.box for p in ordered], [p.writer for p in ordered], None)

    @classmethod
    def of_geometry(cls, geo: Geometry) -> _Lookup:
        return cls(geo.boxes, None, geo)

    @classmethod
    def of_mesh(cls, geo: MeshGeometry, ranks: Sequence[int]) -> _Lookup:
        """The boxes of a mesh geometry (in box order already), the writers of those one rank holds fixed."""
        fixed = [ranks[h[0]] if len(h) == 1 else -1 for h in geo.holders]
        return cls(geo.boxes, None, _MeshWriters(geo, ranks), fixed)

    def cover(self, entry: TensorEntry, box: Box) -> _Cover:
        key = (box.offsets, box.shape)
        found = self._memo.get(key)
        if found is None:
            hits = self._overlaps(box)
            filled = sum(region.numel for _, _, region in hits)
            if filled != box.numel:
                raise CheckpointIndexError(
                    f"tensor {entry.name!r}: the source pieces cover {filled} of the {box.numel} elements of box "
                    f"{box.to_json()}; the checkpoint's files do not match its index (run `moeckpt verify`)"
                )
            found = self._memo[key] = _Cover(hits, box.numel)
        return found

    def _overlaps(self, box: Box) -> tuple[tuple[int, Box, Box], ...]:
        """(source position, source box, overlap) of every source box overlapping ``box``."""
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
                out.append((k, self.boxes[k], region))
        return tuple(out)


class _MeshWriters:
    """A mesh geometry's writers as the planner asks for them (``writer(box position, name seed)``), the same
    rotation over replicas as :func:`~.mesh.entry_pieces` (what a save wrote)."""

    __slots__ = ("geo", "ranks")

    def __init__(self, geo: MeshGeometry, ranks: Sequence[int]):
        self.geo, self.ranks = geo, ranks

    def writer(self, k: int, seed: int) -> int:
        return self.geo.writer(k, self.ranks, seed)


def _fixed_writers(geo: Geometry) -> list[int]:
    """Per box of ``geo``: its writer when one rank holds it (the same for every tensor of the structure), else -1
    (a replicated box's writer rotates with the tensor's name)."""
    return [geo.writer(k, 0) if _one_holder(h) else -1 for k, h in enumerate(geo.holders)]


def _one_holder(holders: tuple[Sequence[int], Sequence[int]]) -> bool:
    return len(holders[0]) * len(holders[1]) == 1


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


class SourcePositions:
    """Numbers for the stored source pieces of each tensor that every member of a group agrees on without talking:
    a piece's position in the planner's sorted lookup of its tensor (box order, the order the exchange plan sorts
    units in). A collective load names the units it needs by these numbers (:mod:`.rank_exchange`), and decodes
    the ones it reads for others back to boxes and writers."""

    def __init__(self, index: Index, sources: Mapping[str, Sequence[SourcePiece]] | None = None):
        self._index = index
        self._tensors = _Tensors(index, source_layout(index), sources)
        self._numbers: dict[int, dict[tuple, int]] = {}  # by id of a lookup: (offsets, shape) -> position
        #: the checkpoint's tensor names, sorted, and each name's position among them.
        self.names = sorted(index.tensors)
        self.numbers = {name: t for t, name in enumerate(self.names)}

    def _lookup(self, name: str) -> _Lookup:
        return self._tensors.of(self._index.tensors[name]).lookup

    def position(self, name: str, box: Box) -> int:
        """The position of stored piece ``box`` of tensor ``name``."""
        lk = self._lookup(name)
        numbers = self._numbers.get(id(lk))
        if numbers is None:
            numbers = self._numbers[id(lk)] = {(b.offsets, b.shape): k for k, b in enumerate(lk.boxes)}
        return numbers[(box.offsets, box.shape)]

    def piece(self, name: str, k: int) -> tuple[Box, int]:
        """The box and writer of stored piece ``k`` of tensor ``name``."""
        t = self._tensors.of(self._index.tensors[name])
        return t.lookup.boxes[k], t.writer(k)
