"""Device-mesh shardings: the boxes a DTensor's placements give each rank of its mesh.

A DTensor lives on a device mesh (an n-d array of global ranks) with one placement per mesh dimension:

* ``R``: replicated over that mesh dimension;
* ``S(d)``: tensor dim ``d`` split over that mesh dimension with ``torch.chunk`` semantics (``ceil(n / k)`` per
  part; the last part may be short and trailing parts empty);
* ``SS(d,f)``: torch's ``_StridedShard(d, split_factor=f)``, which FSDP2 + TP produce: dim ``d`` is first cut in
  ``f`` parts (the shards a later placement makes), each part is split over this mesh dimension, and a rank holds
  its share of every part, concatenated.

Placements apply left to right, each to what the previous ones left a rank (``torch``'s
``_compute_local_shape_and_global_offset`` does the same). Along each tensor dimension a rank's local tensor is
then a sequence of intervals of global indices; across dimensions, their product. So a local tensor is a grid of
boxes (usually one box), and each box sits at a known place in the local tensor: saving splits the local tensor
into those boxes, loading fills them in place. Pure functions, no process group: every rank computes every
rank's boxes from the mesh shape alone.
"""

from __future__ import annotations

import itertools
import math
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError

__all__ = [
    "MeshGeometry",
    "MeshPlacement",
    "local_boxes",
    "local_intervals",
    "mesh_geometry",
    "mesh_local_shape",
    "parse_placements",
]

Interval = tuple[int, int]


@dataclass(frozen=True)
class MeshPlacement:
    """One mesh dimension's placement: ``kind`` is ``R``, ``S`` or ``SS`` (strided shard)."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("R", "S", "SS"):
            raise LayoutError(f"placement kind {self.kind!r} is not R, S or SS")
        if self.kind != "R" and self.dim < 0:
            raise LayoutError(f"placement {self.kind} needs a tensor dimension >= 0, got {self.dim}")
        if self.split_factor < 1:
            raise LayoutError(f"placement split factor must be >= 1, got {self.split_factor}")

    def to_json(self) -> str:
        if self.kind == "R":
            return "R"
        if self.kind == "S":
            return f"S({self.dim})"
        return f"SS({self.dim},{self.split_factor})"

    @classmethod
    def from_json(cls, value: object, where: str = "placement") -> MeshPlacement:
        if value == "R":
            return cls("R")
        m = _PLACEMENT.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise LayoutError(f"{where}: {value!r} is not a placement (R, S(dim) or SS(dim,split_factor))")
        if m.group(1) == "S":
            if m.group(3) is not None:
                raise LayoutError(f"{where}: {value!r}: S(dim) takes one number")
            return cls("S", int(m.group(2)))
        if m.group(3) is None:
            raise LayoutError(f"{where}: {value!r}: SS(dim,split_factor) takes two numbers")
        if int(m.group(3)) < 1:
            raise LayoutError(f"{where}: {value!r}: the split factor must be >= 1")
        return cls("SS", int(m.group(2)), int(m.group(3)))


_PLACEMENT = re.compile(r"(SS|S)\((\d{1,4})(?:,(\d{1,9}))?\)")


#: parsed placements by (strings, tensor rank, mesh rank): every layer's tensors repeat a few placement lists.
_PARSED: dict[tuple, tuple[MeshPlacement, ...]] = {}


def parse_placements(values: object, ndim: int, mesh_ndim: int, where: str) -> tuple[MeshPlacement, ...]:
    """Validate a list of placement strings against a tensor's rank and its mesh's."""
    key = (tuple(values), ndim, mesh_ndim) if isinstance(values, list) and all(type(v) is str for v in values) else None
    found = _PARSED.get(key) if key is not None else None
    if found is not None:
        return found
    out = _parse_placements(values, ndim, mesh_ndim, where)
    if key is not None:
        if len(_PARSED) > 10_000:
            _PARSED.clear()
        _PARSED[key] = out
    return out


def _parse_placements(values: object, ndim: int, mesh_ndim: int, where: str) -> tuple[MeshPlacement, ...]:
    if not isinstance(values, list) or len(values) != mesh_ndim:
        raise LayoutError(
            f"{where}: 'placements' must list one placement per mesh dimension ({mesh_ndim}), got {values!r}"
        )
    out = tuple(MeshPlacement.from_json(v, where) for v in values)
    for p in out:
        if p.kind != "R" and p.dim >= ndim:
            raise LayoutError(f"{where}: placement {p.to_json()} names dim {p.dim} of a {ndim}-d tensor")
    return out


def _take(seq: Sequence[Interval], lo: int, hi: int) -> list[Interval]:
    """Positions ``[lo, hi)`` of the index sequence made of ``seq`` (intervals in order), as intervals."""
    out: list[Interval] = []
    pos = 0
    for a, b in seq:
        n = b - a
        s, e = max(lo, pos), min(hi, pos + n)
        if e > s:
            out.append((a + s - pos, a + e - pos))
        pos += n
        if pos >= hi:
            break
    return out


def _chunk(seq: Sequence[Interval], parts: int, i: int) -> list[Interval]:
    """Part ``i`` of ``parts`` of a sequence, with ``torch.chunk`` semantics (empty parts past the end)."""
    total = sum(b - a for a, b in seq)
    size = -(-total // parts) if total else 0
    return _take(seq, min(i * size, total), min((i + 1) * size, total))


def local_intervals(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[MeshPlacement]
) -> list[list[Interval]]:
    """Per tensor dimension, the global index intervals the rank at mesh ``coord`` holds, in local order."""
    dims: list[list[Interval]] = [[(0, int(n))] if n else [] for n in shape]
    for mesh_dim, p in enumerate(placements):
        if p.kind == "R":
            continue
        k, c = mesh_shape[mesh_dim], coord[mesh_dim]
        seq = dims[p.dim]
        if p.kind == "S":
            dims[p.dim] = _chunk(seq, k, c)
        else:
            pieces = [_chunk(seq, p.split_factor, j) for j in range(p.split_factor)]
            dims[p.dim] = [iv for piece in pieces for iv in _chunk(piece, k, c)]
    return dims


def mesh_local_shape(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[MeshPlacement]
) -> tuple[int, ...]:
    """The shape of the rank's local tensor of a DTensor (what ``DTensor.to_local()`` has); a layout's local
    tensors are :func:`~.local.local_shape`'s."""
    return tuple(sum(b - a for a, b in seq) for seq in local_intervals(shape, mesh_shape, coord, placements))


def local_boxes(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Sequence[MeshPlacement]
) -> list[tuple[Box, tuple[int, ...]]]:
    """The boxes of the rank's local tensor, each with its offsets inside the local tensor, in row-major order."""
    if not shape:
        return [(Box((), ()), ())]
    per_dim = local_intervals(shape, mesh_shape, coord, placements)
    if any(not seq for seq in per_dim):
        return []
    starts = []
    for seq in per_dim:
        pos, s = 0, []
        for a, b in seq:
            s.append(pos)
            pos += b - a
        starts.append(s)
    out = []
    for combo in itertools.product(*(range(len(seq)) for seq in per_dim)):
        ivs = [per_dim[d][i] for d, i in enumerate(combo)]
        box = Box(tuple(a for a, _ in ivs), tuple(b - a for a, b in ivs))
        out.append((box, tuple(starts[d][i] for d, i in enumerate(combo))))
    return out


@dataclass(frozen=True)
class MeshGeometry:
    """The distinct boxes of a tensor on a mesh, each with the flat mesh positions (row-major) that hold it."""

    boxes: tuple[Box, ...]
    holders: tuple[tuple[int, ...], ...]

    def writer(self, i: int, ranks: Sequence[int], seed: int) -> int:
        """The global rank that writes box ``i``: the holders take turns (by box and tensor), so replicated
        tensors spread their writes over the replicas."""
        h = self.holders[i]
        return ranks[h[(seed + i) % len(h)]]


_GEOMETRY: dict[tuple, MeshGeometry] = {}


def mesh_geometry(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[MeshPlacement]) -> MeshGeometry:
    """Every distinct box over the whole mesh (cached: the same structure recurs in every layer)."""
    key = (tuple(shape), tuple(mesh_shape), tuple(placements))
    found = _GEOMETRY.get(key)
    if found is None:
        if len(_GEOMETRY) > 10_000:
            _GEOMETRY.clear()
        found = _GEOMETRY[key] = _compute_geometry(shape, mesh_shape, placements)
    return found


def _compute_geometry(shape, mesh_shape, placements) -> MeshGeometry:
    # A rank's boxes depend only on its coordinates along the mesh dims that shard: visit one coordinate per
    # class and expand the replicated dims afterwards, so a 1,024-rank mesh costs its distinct pieces.
    sharded = [i for i, p in enumerate(placements) if p.kind != "R"]
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
    found: dict[Box, list[int]] = {}
    for sub in itertools.product(*(range(mesh_shape[i]) for i in sharded)):
        coord = [0] * len(mesh_shape)
        for i, c in zip(sharded, sub):
            coord[i] = c
        boxes = [b for b, _ in local_boxes(shape, mesh_shape, coord, placements) if not b.is_empty()]
        if not boxes:
            continue
        flats = _expand(coord, [i for i in range(len(mesh_shape)) if i not in sharded], mesh_shape, strides)
        for b in boxes:
            found.setdefault(b, []).extend(flats)
    keys = sorted(found)
    return MeshGeometry(tuple(keys), tuple(tuple(sorted(found[k])) for k in keys))


def _expand(coord: list[int], free: list[int], mesh_shape: Sequence[int], strides: list[int]) -> list[int]:
    base = sum(c * s for c, s in zip(coord, strides))
    flats = [base]
    for i in free:
        flats = [f + j * strides[i] for f in flats for j in range(mesh_shape[i])]
    return flats


def name_seed(name: str) -> int:
    """The writer rotation seed of a tensor (stable across processes, unlike ``hash``)."""
    return zlib.crc32(name.encode())


def entry_placements(entry) -> tuple[MeshPlacement, ...]:
    """The parsed placements of a tensor entry with a mesh sharding (``entry.mesh`` set)."""
    mesh = entry.mesh
    return parse_placements(
        entry.sharding.get("placements"), len(entry.shape), len(mesh.shape), f"tensor {entry.name!r}"
    )


def entry_pieces(entry) -> list[tuple[Box, int]]:
    """``(box, writer rank)`` of every distinct stored box of a mesh-sharded tensor entry, in box order."""
    mesh = entry.mesh
    geo = mesh_geometry(entry.shape, mesh.shape, entry_placements(entry))
    seed = name_seed(entry.name)
    return [(b, geo.writer(i, mesh.ranks, seed)) for i, b in enumerate(geo.boxes)]


def entry_rank_boxes(entry, rank: int) -> list[Box]:
    """The non-empty boxes ``rank`` holds of a mesh-sharded tensor entry (none if the rank is not in its mesh)."""
    mesh = entry.mesh
    try:
        flat = mesh.ranks.index(rank)
    except ValueError:
        return []
    coord = []
    for n in reversed(mesh.shape):
        flat, r = divmod(flat, n)
        coord.append(r)
    coord.reverse()
    return [b for b, _ in local_boxes(entry.shape, mesh.shape, coord, entry_placements(entry)) if not b.is_empty()]
