"""The exchange plan of a collective load: which member reads each source row chunk, and in which round it goes.

Pure and deterministic (no processes, no I/O), so every member of a group computes the same plan without
talking: :func:`plan_exchange` takes the load plan of every member (:func:`~moeckpt.reshard.planner.plan_load`)
and splits the source row chunks the members need into units, one reader (owner) per unit, the least-loaded
member among those that need it, then cuts the units' global order into rounds of bounded size. The collective
load (:mod:`moeckpt.reshard.load`) runs the rounds with ``all_to_all_single``.

This whole-group plan is the definition: a collective load no longer computes it (its cost grows with the
group), but each member's part of it, from the members' summaries (:mod:`.rank_exchange`, which reuses the
chunk cutting and the seed here, and whose tests compare it with this plan).

Members of one layout share most target pieces (replicas hold equal boxes, and :func:`plan_load` gives them one
:class:`~moeckpt.reshard.plan.TargetPiece` value), so the units of a piece are cut once per distinct piece,
not once per member holding it.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import Index

from .chunks import chunk_rows
from .plan import ReshardPlan, TargetPiece

#: a unit: (tensor, source box offsets, source box shape, source writer, chunk number).
UnitKey = tuple[str, tuple[int, ...], tuple[int, ...], int, int]


@dataclass(frozen=True)
class ExchangePlan:
    """Who reads what in a collective load, and when."""

    #: per unit, ``(destination group rank, target piece position, sub-region)`` of everyone needing part of it.
    units: dict[UnitKey, list[tuple[int, int, Box]]]
    #: the group rank that reads each unit.
    owner: dict[UnitKey, int]
    #: the units of each round, in the one global order every member follows.
    rounds: list[list[UnitKey]]


def plan_exchange(
    index: Index,
    plan: ReshardPlan,
    chunk_bytes: int,
    round_bytes: int,
    *,
    readable: Sequence[Collection[int] | None] | None = None,
    location: str = "",
) -> ExchangePlan:
    """The exchange plan of ``plan`` (one :class:`~moeckpt.reshard.plan.RankPlan` per group member, in group
    rank order), on the row chunks of ``chunk_bytes`` the chunk readers share, in rounds of ``round_bytes`` per
    member. ``readable`` lists per member the writers whose files it can read (``None``: all; node-local memory
    checkpoints, say): each unit is then read by a member that can read it (``location`` names the checkpoint in
    the error when none can)."""
    size = len(plan.ranks)
    units: dict[UnitKey, list[tuple[int, int, Box]]] = {}
    unit_bytes: dict[UnitKey, int] = {}
    cut: dict[int, tuple[tuple[UnitKey, Box], ...]] = {}  # by id of a shared TargetPiece: its units, once
    chunked: dict[tuple, tuple[tuple[int, Box, int], ...]] = {}
    for g, rank_plan in enumerate(plan.ranks):
        for pos, piece in enumerate(rank_plan.pieces):
            parts = cut.get(id(piece))
            if parts is None:
                parts = cut[id(piece)] = _cut(index, piece, chunk_bytes, unit_bytes, chunked)
            for key, sub in parts:
                found = units.get(key)
                if found is None:
                    units[key] = [(g, pos, sub)]
                else:
                    found.append((g, pos, sub))
    order = sorted(units)
    # One reader per unit, among the ranks that need it, balancing the bytes each rank reads.
    load = [0] * size
    owner: dict[UnitKey, int] = {}
    for key in order:
        needs = units[key]
        first = needs[0][0]
        if readable is not None:
            needers = _readers_of(key[3], sorted({g for g, _, _ in needs}), readable, location)
            seed = unit_seed(key)
            pick = min(needers, key=lambda g: (load[g], (g - seed) % size))
        elif all(g == first for g, _, _ in needs):  # one rank needs it (a ZeRO part): it reads it
            pick = first
        else:
            needers = sorted({g for g, _, _ in needs})
            seed = unit_seed(key)
            pick = min(needers, key=lambda g: (load[g], (g - seed) % size))
        owner[key] = pick
        load[pick] += unit_bytes[key]
    # Rounds of bounded size: cut the global order whenever one rank would read more than round_bytes.
    rounds: list[list[UnitKey]] = [[]]
    round_load = [0] * size
    for key in order:
        o = owner[key]
        if rounds[-1] and round_load[o] + unit_bytes[key] > round_bytes:
            rounds.append([])
            round_load = [0] * size
        rounds[-1].append(key)
        round_load[o] += unit_bytes[key]
    return ExchangePlan(units, owner, rounds)


def _readers_of(writer: int, needers: list[int], readable, location: str) -> list[int]:
    """The members that may read ``writer``'s file: those of ``needers`` that can, else any member that can."""

    def can(g: int) -> bool:
        return readable[g] is None or writer in readable[g]

    able = [g for g in needers if can(g)] or [g for g in range(len(readable)) if can(g)]
    if not able:
        raise LayoutError(f"{location}: no member of the collective load can read the file of writer {writer}")
    return able


def _cut(
    index: Index, piece: TargetPiece, chunk_bytes: int, unit_bytes: dict[UnitKey, int], chunked: dict
) -> tuple[tuple[UnitKey, Box], ...]:
    """The units ``piece`` needs, each with the sub-region of it that lands in the piece (recording each unit's
    bytes in ``unit_bytes``). The chunks a region meets depend on its geometry only, shared through ``chunked``
    by the tensors of one structure."""
    dtype = index.tensors[piece.tensor].dtype
    out = []
    for item in piece.reads:
        src, region = item.src_box, item.region
        geo = (src.offsets, src.shape, region.offsets, region.shape, dtype)
        parts = chunked.get(geo)
        if parts is None:
            parts = chunked[geo] = chunks_of(src, region, dtype, chunk_bytes)
        for c, sub, nbytes in parts:
            key = (item.tensor, src.offsets, src.shape, item.writer, c)
            if key not in unit_bytes:
                unit_bytes[key] = nbytes
            out.append((key, sub))
    return tuple(out)


def chunks_of(src: Box, region: Box, dtype: str, chunk_bytes: int) -> tuple[tuple[int, Box, int], ...]:
    """(chunk number, the part of ``region`` in that chunk of the stored piece ``src``, the chunk's bytes)."""
    per = chunk_rows(src, dtype, chunk_bytes)
    item_bytes = dtypes.itemsize(dtype)
    if src.ndim:
        r0 = region.offsets[0] - src.offsets[0]
        r1 = r0 + region.shape[0]
    else:
        r0, r1 = 0, 1
    out = []
    for c in range(r0 // per, (r1 - 1) // per + 1):
        lo, hi = c * per, min((c + 1) * per, src.shape[0] if src.ndim else 1)
        if src.ndim:
            rows_box = Box.trusted((src.offsets[0] + lo,) + src.offsets[1:], (hi - lo,) + src.shape[1:])
            sub = region.intersect(rows_box)
        else:
            sub = region
        if sub is None:
            continue
        out.append((c, sub, (hi - lo) * (src.numel // max(1, src.shape[0]) if src.ndim else 1) * item_bytes))
    return tuple(out)


def unit_seed(key: tuple) -> int:
    """A stable small integer per unit (Python's ``hash`` of str is salted per process; ranks must agree)."""
    return zlib.crc32(repr(key).encode())
