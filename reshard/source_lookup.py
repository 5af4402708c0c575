"""Which stored source boxes a target box meets, found fast: the sorted lookups the planner shares between the
tensors of one structure, and the numbers of stored pieces that the members of a group agree on.

A model's tensors come in structures (every layer's weights have one shape and one sharding), so the lookup of the
source boxes is built once per source geometry and one :class:`Cover` (the source boxes a target box overlaps)
serves every tensor of the structure; only the writers of replicated boxes differ, rotating with the tensor's name.
An offline plan at 1,024 ranks meets millions of boxes: the read items are built with ``tuple.__new__`` (named
tuples, see :mod:`.plan`), and a geometry's writers for a tensor come from one table (:class:`Rotation`).
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Mapping, Sequence
from typing import cast

import numpy as np

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import CheckpointIndexError
from moeckpt.formats.index import Index, TensorEntry

from .layout import Layout
from .mesh import MeshGeometry, entry_placements, mesh_geometry
from .placement import Geometry, geometry, is_stored
from .plan import ReadItem, SourcePiece, source_layout

#: builds a plan value (a named tuple) in C, without its Python-level ``__new__``.
_tuple = tuple.__new__


class Cover:
    """The source boxes one target box overlaps, shared by every tensor of the same structure (its reads differ
    only by the tensor's name and the writers its name picks)."""

    __slots__ = ("hits", "numel", "read_elems", "spans")

    def __init__(self, hits: tuple[tuple[int, Box, Box], ...], numel: int):
        #: (source position, source box, overlap) per source box the target box meets.
        self.hits = hits
        self.numel = numel
        #: per source box: (its (offsets, shape), rows ``[r0, r1)`` read, elements per row).
        self.spans = tuple((_key(src), _rows(src, region), _row_elems(src)) for _, src, region in hits)
        self.read_elems = union_elems([self])


def _key(box: Box) -> tuple:
    return (box.offsets, box.shape)


def _rows(src: Box, region: Box) -> tuple[int, int]:
    if not src.ndim:
        return (0, 1)
    r0 = region.offsets[0] - src.offsets[0]
    return (r0, r0 + region.shape[0])


def _row_elems(src: Box) -> int:
    return (src.numel // src.shape[0]) if src.ndim and src.shape[0] else src.numel


def union_elems(covers: Sequence[Cover]) -> int:
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


class SourceTensor:
    """One source tensor as the planner reads it: its lookup, item size, name seed and source writers."""

    __slots__ = ("name", "lookup", "itemsize", "seed", "_writers")

    def __init__(self, name: str, lookup: SourceLookup, itemsize: int):
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

    def reads(self, cover: Cover, box: Box) -> tuple[ReadItem, ...]:
        """The read items of ``box`` from the source boxes ``cover`` lists."""
        name, lk = self.name, self.lookup
        known = lk.writers if lk.writers is not None else lk.fixed
        out = []
        for k, src, region in cover.hits:
            w = known[k]
            if w < 0:
                w = self.writer(k)
            out.append(_tuple(ReadItem, (name, src, w, region, box)))
        return tuple(out)


class SourceTensors:
    """Per-name :class:`SourceTensor` values; tensors of one structure share the source geometry's lookup."""

    def __init__(self, index: Index, layout: Layout, sources: Mapping[str, Sequence[SourcePiece]] | None):
        self.index, self.layout, self.sources = index, layout, sources
        self.by_name: dict[str, SourceTensor] = {}
        self._lookups: dict[int, SourceLookup] = {}
        self._mesh_lookups: dict[tuple, SourceLookup] = {}

    def of(self, entry: TensorEntry) -> SourceTensor:
        found = self.by_name.get(entry.name)
        if found is None:
            found = self.by_name[entry.name] = SourceTensor(
                entry.name, self._lookup(entry), dtypes.itemsize(entry.dtype)
            )
        return found

    def _lookup(self, entry: TensorEntry) -> SourceLookup:
        sources = self.sources
        if sources is not None and (entry.name in sources or is_stored(entry)):
            return SourceLookup.of_pieces(sources.get(entry.name, ()))
        if entry.mesh is not None:
            # A device-mesh sharding: tensors of one structure on one mesh share its boxes and their covers (every
            # layer's weights); only a replicated box's writer differs, rotating with the tensor's name.
            mesh = entry.mesh
            geo_m = mesh_geometry(entry.shape, mesh.shape, entry_placements(entry))
            key = (id(geo_m), tuple(mesh.ranks))
            found = self._mesh_lookups.get(key)
            if found is None:
                found = self._mesh_lookups[key] = SourceLookup.of_mesh(geo_m, mesh.ranks)
            return found
        # From the index alone: tensors of one structure share the source geometry and its sorted lookup.
        geo = geometry(entry, self.layout)
        found = self._lookups.get(id(geo))
        if found is None:
            found = self._lookups[id(geo)] = SourceLookup.of_geometry(geo)
        return found


class SourceLookup:
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
            fixed = [] if not isinstance(geo, Geometry) else fixed_writers(geo)
        self.fixed = fixed
        self._memo: dict[tuple, Cover] = {}

    @classmethod
    def of_pieces(cls, pieces: Sequence[SourcePiece]) -> SourceLookup:
        ordered = sorted(pieces, key=lambda p: (p.box.offsets, p.box.shape))
        return cls([p.box for p in ordered], [p.writer for p in ordered], None)

    @classmethod
    def of_geometry(cls, geo: Geometry) -> SourceLookup:
        return cls(geo.boxes, None, geo)

    @classmethod
    def of_mesh(cls, geo: MeshGeometry, ranks: Sequence[int]) -> SourceLookup:
        """The boxes of a mesh geometry (in box order already), the writers of those one rank holds fixed."""
        fixed = [ranks[h[0]] if len(h) == 1 else -1 for h in geo.holders]
        return cls(geo.boxes, None, _MeshWriters(geo, ranks), fixed)

    def cover(self, entry: TensorEntry, box: Box) -> Cover:
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
            found = self._memo[key] = Cover(hits, box.numel)
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


class Rotation:
    """The writers of a geometry's boxes for any tensor of its structure, all at once: box ``i``'s writer is its
    holder number ``(seed + i) % holders`` (:meth:`~.placement.Geometry.writer`), looked up in one table of every
    box's holders in their order."""

    def __init__(self, geo: Geometry):
        fixed = fixed_writers(geo)
        self.fixed = np.array(fixed, dtype=np.int64)
        self.rotating = np.flatnonzero(self.fixed < 0)
        holders = [_holders(geo, int(i)) for i in self.rotating]
        self.count = np.array([len(h) for h in holders], dtype=np.int64)
        self.start = np.cumsum(self.count) - self.count
        self.table = np.array([r for h in holders for r in h], dtype=np.int64)

    def of(self, seed: int) -> np.ndarray:
        """The writer of every box for a tensor whose name hashes to ``seed``."""
        if not len(self.rotating):
            return self.fixed
        out = self.fixed.copy()
        out[self.rotating] = self.table[self.start + (seed + self.rotating) % self.count]
        return out


def _holders(geo: Geometry, i: int) -> list[int]:
    """The ranks holding box ``i`` in the order :meth:`~.placement.Geometry.writer` numbers them."""
    tps, dps = geo.holders[i]
    return [d * geo.tp + t for d in dps for t in tps]


def fixed_writers(geo: Geometry) -> list[int]:
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
        self._tensors = SourceTensors(index, source_layout(index), sources)
        self._numbers: dict[int, dict[tuple, int]] = {}  # by id of a lookup: (offsets, shape) -> position
        #: the checkpoint's tensor names, sorted, and each name's position among them.
        self.names = sorted(index.tensors)
        self.numbers = {name: t for t, name in enumerate(self.names)}

    def _lookup(self, name: str) -> SourceLookup:
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
