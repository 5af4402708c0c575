"""Where Muon's matrices meet: each parameter's logical matrices, the stored pieces of each, the rank(s) that
orthogonalize it, and the transfers that bring the pieces there (and the result back).

Newton-Schulz needs a whole logical matrix, but under ZeRO-1 and TP a matrix is spread over ranks as boxes: the
momentum's ZeRO parts (role ``momentum``, exactly :func:`~moeckpt.reshard.placement.rank_boxes`) of each TP shard.
Everything here is a pure function of the plan and the layout (no processes, no tensors), so every rank derives the
same exchange without talking, and a test can check the plans of all ranks against each other.

Two schemes:

* ``assign``: each matrix is orthogonalized by one rank holding part of it, picked greedily by Newton-Schulz cost so
  the work balances; its pieces travel there and the result travels back (two all-to-alls a step; the scheme of
  Dion's and Essential AI's distributed Muon). An expert whose ZeRO part holds it whole stays where it is.
* ``gather``: every rank holding part of a matrix receives all of it and orthogonalizes it itself, keeping its own
  slice (Moonlight's "Distributed Muon": a gather over the owning group; one all-to-all, the work repeated on every
  holder).

A transfer moves one box of the global tensor (a run of consecutive matrices of one family, so an expert tensor's
part travels as one copy) from ``src`` to ``dst``; ``src == dst`` is a local copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import MOMENTUM
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import geometry
from moeckpt.reshard.tensors import Matrices, ParamSpec, tensor_name

from .config import MUON_SCHEMES

__all__ = ["SCHEMES", "Family", "RankPlan", "Transfer", "families", "matrix_pieces", "rank_plan", "receives", "sends"]

#: the exchange schemes (``MuonConfig.scheme``).
SCHEMES = MUON_SCHEMES


@dataclass(frozen=True)
class Family:
    """The logical matrices of one parameter that share one block: one per expert (``batch`` of them), or one."""

    #: position in plan order (orders everything deterministically).
    index: int
    param: str
    #: matrices in the family (the experts of a batched tensor, else 1).
    batch: int
    #: whether the tensor has a leading matrix (expert) dimension.
    batched: bool
    #: first row of the family's block in the first matrix dimension.
    row0: int
    #: ``(rows, cols)`` of each matrix.
    shape: tuple[int, int]

    def box(self, first: int = 0, count: int | None = None) -> Box:
        """The global box of matrices ``[first, first + count)`` (all of them by default)."""
        rows, cols = self.shape
        if not self.batched:
            return Box((self.row0, 0), (rows, cols))
        return Box((first, self.row0, 0), (self.batch - first if count is None else count, rows, cols))

    def matrix_of(self, box: Box) -> tuple[int, int]:
        """``(first matrix, count)`` of a box inside the family."""
        return (box.offsets[0], box.shape[0]) if self.batched else (0, 1)


def families(spec: ParamSpec, index: int) -> list[Family]:
    """The families of ``spec.matrix``; ``index`` numbers the first (the plan position of the parameter times a
    bound on blocks keeps numbers unique). Raises :class:`LayoutError` for a rule that does not describe 2-D
    matrices of the tensor."""
    m: Matrices | None = spec.matrix
    if m is None:
        return []
    shape = tuple(spec.shape)
    batched = m.batch_dim is not None
    if batched and m.batch_dim != 0:
        raise LayoutError(f"{spec.name}: Matrices.batch_dim must be 0 (the experts) or None, got {m.batch_dim}")
    if len(shape) != 2 + batched:
        raise LayoutError(f"{spec.name}: shape {list(shape)} is not {'a batch of ' if batched else ''}2-D matrices")
    first = 1 if batched else 0
    rows, cols = shape[first], shape[first + 1]
    blocks = tuple(m.blocks) if m.blocks is not None else (rows,)
    if sum(blocks) != rows or any(b <= 0 for b in blocks):
        raise LayoutError(f"{spec.name}: matrix blocks {list(blocks)} do not split its {rows} rows")
    out, row0 = [], 0
    for j, b in enumerate(blocks):
        out.append(
            Family(
                index=index + j,
                param=spec.name,
                batch=shape[0] if batched else 1,
                batched=batched,
                row0=row0,
                shape=(b, cols),
            )
        )
        row0 += b
    return out


#: one stored piece of one matrix: its box (one matrix) and the ranks holding it.
_Piece = tuple[Box, tuple[int, ...]]


def _holders(geo, i: int) -> tuple[int, ...]:
    tps, dps = geo.holders[i]
    return tuple(sorted(d * geo.tp + t for d in dps for t in tps))


def matrix_pieces(spec: ParamSpec, fams: Sequence[Family], layout: Layout) -> dict[tuple[int, int], list[_Piece]]:
    """Every stored piece of every matrix of ``fams`` (one parameter) in ``layout``: ``(family index, matrix)`` ->
    ``[(box of that matrix, holder ranks)]``, in box order."""
    entry = TensorEntry(
        name=tensor_name(spec.name, MOMENTUM),
        shape=tuple(spec.shape),
        dtype="float32",
        role=MOMENTUM,
        param=spec.name,
        sharding=spec.rule.to_json(),
    )
    geo = geometry(entry, layout)
    out: dict[tuple[int, int], list[_Piece]] = {(f.index, e): [] for f in fams for e in range(f.batch)}
    for i, z in enumerate(geo.boxes):
        holders = _holders(geo, i)
        for f in fams:
            s = z.intersect(f.box())
            if s is None:
                continue
            first, count = f.matrix_of(s)
            for e in range(first, first + count):
                one = Box((e, *s.offsets[1:]), (1, *s.shape[1:])) if f.batched else s
                out[(f.index, e)].append((one, holders))
    return out


@dataclass(frozen=True, order=True)
class Transfer:
    """One box of one family's matrices going from rank ``src`` to rank ``dst`` (a local copy when equal)."""

    family: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    src: int
    dst: int

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class RankPlan:
    """One rank's share of the exchange.

    ``computes`` lists the matrices this rank orthogonalizes, grouped by shape, in stacking order. ``forward`` are
    the transfers of pieces to the computing ranks that this rank sends or receives (local ones included),
    ``backward`` those of results to the holders (``assign``; under ``gather`` only local copies: each holder keeps
    its slice of what it computed).
    """

    rank: int
    #: every family of the plan, by index.
    families: dict[int, Family]
    computes: dict[tuple[int, int], list[tuple[int, int]]]
    forward: list[Transfer]
    backward: list[Transfer]

    def position(self) -> dict[tuple[int, int], tuple[tuple[int, int], int]]:
        """``(family, matrix)`` -> ``(shape, index in that shape's stack)`` for what this rank computes."""
        return {m: (shape, i) for shape, ms in self.computes.items() for i, m in enumerate(ms)}


def sends(transfers: Iterable[Transfer], rank: int) -> list[Transfer]:
    """The ``transfers`` ``rank`` sends to others, in buffer order (by destination, then family and box)."""
    return sorted((t for t in transfers if t.src == rank != t.dst), key=lambda t: (t.dst, t.family, t.offsets))


def receives(transfers: Iterable[Transfer], rank: int) -> list[Transfer]:
    """The ``transfers`` ``rank`` receives from others, in buffer order (by source, then family and box): what
    the sender's :func:`sends` lists for it, in the same order."""
    return sorted((t for t in transfers if t.dst == rank != t.src), key=lambda t: (t.src, t.family, t.offsets))


def _cost(shape: tuple[int, int]) -> int:
    """Newton-Schulz work of one matrix, up to a constant: each iteration multiplies [m, n] by [n, m] and [m, m]
    matrices, ``m = min(rows, cols)``."""
    rows, cols = shape
    return rows * cols * min(rows, cols)


def _source(holders: tuple[int, ...], dst: int, tp: int) -> int:
    """The holder that sends a piece to ``dst``: ``dst`` itself, else the one with its TP rank (a TP-replicated
    piece then travels inside ``dst``'s data-parallel group), else the first."""
    if dst in holders:
        return dst
    for h in holders:
        if h % tp == dst % tp:
            return h
    return holders[0]


def assignment(matrices: dict[tuple[int, int], tuple[tuple[int, int], list[_Piece]]]) -> dict[tuple[int, int], int]:
    """The rank orthogonalizing each matrix under ``assign``: largest first, each to the least-loaded of the ranks
    holding part of it (ties: the lowest rank), so every rank's Newton-Schulz work balances."""
    load: dict[int, int] = {}
    out = {}
    for key in sorted(matrices, key=lambda k: (-_cost(matrices[k][0]), k)):
        shape, pieces = matrices[key]
        candidates = sorted({h for _, hs in pieces for h in hs})
        best = min(candidates, key=lambda r: (load.get(r, 0), r))
        load[best] = load.get(best, 0) + _cost(shape)
        out[key] = best
    return out


def _merge(transfers: list[tuple[Transfer, int, int]], fams: dict[int, Family]) -> list[Transfer]:
    """Join transfers of consecutive matrices of one family between the same ranks into one box."""
    out: list[Transfer] = []
    run: tuple[Transfer, int, int] | None = None
    for t, e, n in sorted(transfers, key=lambda x: (x[0].src, x[0].dst, x[0].family, x[0].offsets[1:], x[1])):
        if (
            run is not None
            and fams[t.family].batched
            and (run[0].src, run[0].dst, run[0].family) == (t.src, t.dst, t.family)
            and run[0].offsets[1:] == t.offsets[1:]
            and run[0].shape[1:] == t.shape[1:]
            and run[1] + run[2] == e
        ):
            first = run[0]
            run = (
                Transfer(first.family, first.offsets, (run[2] + n, *first.shape[1:]), first.src, first.dst),
                run[1],
                run[2] + n,
            )
            continue
        if run is not None:
            out.append(run[0])
        run = (t, e, n)
    if run is not None:
        out.append(run[0])
    return out


def rank_plan(specs: Sequence[ParamSpec], layout: Layout, rank: int, scheme: str = "assign") -> RankPlan:
    """The exchange of ``rank`` for the Muon parameters among ``specs`` (those with ``matrix``) in ``layout``."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} must be one of {', '.join(SCHEMES)}")
    fams: dict[int, Family] = {}
    matrices: dict[tuple[int, int], tuple[tuple[int, int], list[_Piece]]] = {}
    index = 0
    for spec in specs:
        fs = families(spec, index)
        index += max(len(fs), 1)
        if not fs:
            continue
        fams.update((f.index, f) for f in fs)
        for key, pieces in matrix_pieces(spec, fs, layout).items():
            matrices[key] = (fams[key[0]].shape, pieces)
    tp = layout.tp
    if scheme == "assign":
        owner = assignment(matrices)
        computing: dict[tuple[int, int], tuple[int, ...]] = {k: (owner[k],) for k in matrices}
    else:
        computing = {k: tuple(sorted({h for _, hs in pieces for h in hs})) for k, (_, pieces) in matrices.items()}
    computes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    forward: list[tuple[Transfer, int, int]] = []
    backward: list[tuple[Transfer, int, int]] = []
    for key in sorted(matrices):
        shape, pieces = matrices[key]
        fam, e = key
        ranks = computing[key]
        mine = any(rank in hs for _, hs in pieces)
        if rank not in ranks and not mine:
            continue
        if rank in ranks:
            computes.setdefault(shape, []).append(key)
        for box, hs in pieces:
            targets = ranks if rank in hs or scheme == "assign" else (rank,)
            for c in targets:
                src = _source(hs, c, tp)
                if rank in (src, c):
                    forward.append((Transfer(fam, box.offsets, box.shape, src, c), e, 1))
            if scheme == "assign":
                (a,) = ranks
                for h in hs:
                    if rank in (a, h):
                        backward.append((Transfer(fam, box.offsets, box.shape, a, h), e, 1))
            elif rank in hs:
                backward.append((Transfer(fam, box.offsets, box.shape, rank, rank), e, 1))
    return RankPlan(
        rank=rank, families=fams, computes=computes, forward=_merge(forward, fams), backward=_merge(backward, fams)
    )
