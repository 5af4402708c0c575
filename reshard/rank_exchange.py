"""One member's part of a collective load's exchange plan, from compact summaries of what every member needs.

:func:`~moeckpt.reshard.group_plan.plan_exchange` builds the whole group's exchange plan from every member's load
plan; a member that plans every member pays for the whole group, so its time grows with the group. Here each
member plans only its own boxes and reduces them to a :class:`Summary`: the units it needs (source row chunks,
see :mod:`.group_plan`) as integers, with their bytes, writers and seeds. The members all_gather the summaries
(:func:`gather_summaries`, a few integers per unit a member needs), and each member derives from them the same
decisions :func:`~moeckpt.reshard.group_plan.plan_exchange` makes (:func:`decide`: one owner per unit by the same
least-loaded rule, the same rounds), then keeps only what concerns it (:func:`rank_exchange`): the units it reads
or needs, and the transfers it sends or receives. The decisions are a pure function of the gathered arrays,
which are the same on every member, so every member agrees on every owner without further talking.

Units are numbered ``(tensor, stored piece, chunk)``: the tensor's position among the checkpoint's sorted tensor
names, the stored piece's position in the planner's sorted lookup of that tensor
(:class:`~moeckpt.reshard.source_lookup.SourcePositions`), and the chunk's number in the piece; packed into one
integer, their order is the order :func:`~moeckpt.reshard.group_plan.plan_exchange` sorts its unit keys in.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import Index

from .group_plan import ExchangePlan, UnitKey, chunks_of, unit_seed
from .layout import Layout
from .placement import rank_boxes
from .plan import RankPlan
from .source_lookup import SourcePositions

#: bits per field of a packed unit number (tensor, stored piece, chunk): 63 bits in all, an int64.
_BITS = 21
_LIMIT = 1 << _BITS


@dataclass
class Summary:
    """What one member needs, as its own load plan says: the part of it the others see, and its own details."""

    #: the packed numbers of the units it needs, sorted, each once.
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per unit of ``ids``: its bytes.
    nbytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per unit of ``ids``: its writer and seed packed (``writer << 32 | seed``): the source writer whose file holds
    #: it, and the stable number plan_exchange breaks ties between readers with
    #: (:func:`~moeckpt.reshard.group_plan.unit_seed`; each member computes it for its own units, so no member
    #: decodes the group's units to strings).
    tags: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    #: per unit of ``ids`` (same order): its key and ``(piece position, sub-region)`` of each part it needs.
    keys: list[UnitKey] = field(default_factory=list)
    needs: list[list[tuple[int, Box]]] = field(default_factory=list)


def summarize(index: Index, rank_plan: RankPlan, chunk_bytes: int, positions: SourcePositions) -> Summary:
    """The summary of one member's load plan on the row chunks of ``chunk_bytes``."""
    number = positions.numbers
    found: dict[UnitKey, list[tuple[int, Box]]] = {}
    meta: dict[UnitKey, tuple[int, int]] = {}  # key -> (packed number, bytes)
    chunked: dict[tuple, tuple] = {}
    for pos, piece in enumerate(rank_plan.pieces):
        dtype = index.tensors[piece.tensor].dtype
        t = number[piece.tensor]
        for item in piece.reads:
            src, region = item.src_box, item.region
            geo = (src.offsets, src.shape, region.offsets, region.shape, dtype)
            parts = chunked.get(geo)
            if parts is None:
                parts = chunked[geo] = chunks_of(src, region, dtype, chunk_bytes)
            k = -1
            for c, sub, nbytes in parts:
                key = (item.tensor, src.offsets, src.shape, item.writer, c)
                entries = found.get(key)
                if entries is None:
                    if k < 0:
                        k = positions.position(item.tensor, src)
                    if t >= _LIMIT or k >= _LIMIT or c >= _LIMIT or not 0 <= item.writer < 1 << 31:
                        raise LayoutError(
                            f"collective load: tensor {item.tensor!r} has more stored pieces or read chunks than a "
                            f"unit number holds (2**{_BITS}); load with a larger LoadOptions.chunk_bytes"
                        )
                    entries = found[key] = []
                    meta[key] = (((t << _BITS) | k) << _BITS | c, nbytes)
                entries.append((pos, sub))
    order = sorted(found, key=lambda key: meta[key][0])
    return Summary(
        ids=np.array([meta[key][0] for key in order], dtype=np.int64),
        nbytes=np.array([meta[key][1] for key in order], dtype=np.int64),
        tags=np.array([key[3] << 32 | unit_seed(key) for key in order], dtype=np.int64),
        keys=order,
        needs=[found[key] for key in order],
    )


@dataclass
class Decisions:
    """The group's decisions, the same on every member: per unit (in the global order) its owner and round."""

    ids: np.ndarray
    nbytes: np.ndarray
    writers: np.ndarray
    owner: np.ndarray
    #: the position in ``ids`` where each round starts.
    round_starts: np.ndarray
    #: the members needing unit ``u``: ``needers[ptr[u]:ptr[u + 1]]``, ascending.
    ptr: np.ndarray
    needers: np.ndarray


def decide(
    gathered: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
    round_bytes: int,
    *,
    readable: Sequence[Collection[int] | None] | None = None,
    location: str = "",
) -> Decisions:
    """Owners and rounds from every member's ``(ids, nbytes, tags)`` (group rank order), as
    :func:`~moeckpt.reshard.group_plan.plan_exchange` decides them on the whole group's plan."""
    size = len(gathered)
    counts = [len(g[0]) for g in gathered]
    ids_all = np.concatenate([g[0] for g in gathered]).astype(np.int64, copy=False)
    bytes_all = np.concatenate([g[1] for g in gathered]).astype(np.int64, copy=False)
    tags_all = np.concatenate([g[2] for g in gathered]).astype(np.int64, copy=False)
    ranks_all = np.repeat(np.arange(size, dtype=np.int64), counts)
    # One stable sort: units in the global order, the members needing each in ascending rank order.
    perm = np.argsort(ids_all, kind="stable")
    sid, needers = ids_all[perm], ranks_all[perm]
    first = np.flatnonzero(np.r_[True, sid[1:] != sid[:-1]]) if len(sid) else np.zeros(0, np.int64)
    ptr = np.r_[first, len(sid)].astype(np.int64)
    ids = sid[first]
    nbytes, tags = bytes_all[perm], tags_all[perm]
    per_unit = np.repeat(np.arange(len(ids)), np.diff(ptr))
    if len(sid) and (np.any(nbytes != nbytes[first][per_unit]) or np.any(tags != tags[first][per_unit])):
        raise LayoutError(f"{location}: the members of the collective load disagree on the checkpoint's pieces")
    nbytes, tags = nbytes[first], tags[first]
    writers, seeds = tags >> 32, tags & 0xFFFFFFFF
    owner = np.full(len(ids), -1, dtype=np.int64)
    if readable is None:
        # A unit one member needs (a ZeRO part) is read by it; the others are chosen in order below.
        forced = np.diff(ptr) == 1
        owner[forced] = needers[ptr[:-1][forced]]
        choice_start, choice_stop = ptr[:-1], ptr[1:]
        cands = needers
    else:
        cands, choice_start, choice_stop = _readable_choices(ptr, needers, writers, readable, owner, size, location)
    owner = _least_loaded(owner, nbytes, seeds, cands, choice_start, choice_stop, size)
    return Decisions(ids, nbytes, writers, owner, _round_starts(owner, nbytes, round_bytes), ptr, needers)


def _least_loaded(owner, nbytes, seeds, cands, start, stop, size: int) -> np.ndarray:
    """plan_exchange's rule, in the global order: a unit without an owner yet goes to its candidate
    (``cands[start[u]:stop[u]]``) that has read the fewest bytes so far, ties broken by the rotation of the member
    ranks by the unit's seed. Each choice sees the loads of every earlier unit, so this is one pass in order, on
    plain lists (a unit with two candidates, the common case, costs a few list operations)."""
    own, sizes, seed_of = owner.tolist(), nbytes.tolist(), seeds.tolist()
    lo, hi, cl = start.tolist(), stop.tolist(), cands.tolist()
    load = [0] * size
    for u, o in enumerate(own):
        b = sizes[u]
        if o >= 0:
            load[o] += b
            continue
        i, j, seed = lo[u], hi[u], seed_of[u]
        if j - i == 2:
            x, y = cl[i], cl[i + 1]
            lx, ly = load[x], load[y]
            pick = x if lx < ly or (lx == ly and (x - seed) % size < (y - seed) % size) else y
        else:
            pick = min(cl[i:j], key=lambda g: load[g] * size + (g - seed) % size)
        own[u] = pick
        load[pick] += b
    return np.array(own, dtype=np.int64)


def _readable_choices(ptr, needers, writers, readable, owner, size: int, location: str):
    """With ``readable`` (plan_exchange's rule): a unit is read by a member needing it that can read its writer's
    file, else by any member that can. Sets ``owner`` where one member is left; returns the candidates of every
    unit as ``(candidates, start, stop)``: unit ``u``'s are ``candidates[start[u]:stop[u]]``, ascending."""
    width = int(writers.max()) + 1 if len(writers) else 1
    able = np.ones((size, width), dtype=bool)
    for g, allowed in enumerate(readable):
        if allowed is not None:
            able[g] = False
            able[g, [w for w in allowed if 0 <= w < width]] = True
    everyone = [np.flatnonzero(able[:, w]) for w in range(width)]
    parts: list[np.ndarray] = []
    start = np.zeros(len(writers), dtype=np.int64)
    stop = np.zeros(len(writers), dtype=np.int64)
    at = 0
    for u, w in enumerate(writers.tolist()):
        cands = needers[ptr[u] : ptr[u + 1]]
        cands = cands[able[cands, w]]
        if not len(cands):
            cands = everyone[w]
            if not len(cands):
                raise LayoutError(f"{location}: no member of the collective load can read the file of writer {w}")
        if len(cands) == 1:
            owner[u] = cands[0]
        parts.append(cands)
        start[u], stop[u] = at, at + len(cands)
        at += len(cands)
    return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), start, stop


def _key(index: Index, packed: int, writer: int, positions: SourcePositions) -> UnitKey:
    mask = _LIMIT - 1
    t, k, c = packed >> (2 * _BITS), (packed >> _BITS) & mask, packed & mask
    name = positions.names[t]
    box, _ = positions.piece(name, k)
    return (name, box.offsets, box.shape, writer, c)


def _round_starts(owner: np.ndarray, nbytes: np.ndarray, round_bytes: int) -> np.ndarray:
    """Where plan_exchange cuts its rounds: before a unit whose owner would read more than ``round_bytes`` in the
    round so far. Each round is found with running sums per owner over a window that doubles until it holds the
    cut (a window, not the rest of the units: rounds are many when ``round_bytes`` is small)."""
    n = len(owner)
    starts = [0]
    s, window = 0, 4096
    while s < n:
        e = min(n, s + window)
        o, b = owner[s:e], nbytes[s:e]
        order = np.argsort(o, kind="stable")
        sums = np.cumsum(b[order])
        so = o[order]
        group = np.flatnonzero(np.r_[True, so[1:] != so[:-1]])
        before = np.repeat(np.r_[0, sums[group[1:] - 1]], np.diff(np.r_[group, len(so)]))
        running = np.empty_like(sums)
        running[order] = sums - before
        over = np.flatnonzero(running[1:] > round_bytes)
        if len(over):
            cut = s + 1 + int(over[0])
            starts.append(cut)
            window = max(4096, 2 * (cut - s))
            s = cut
        elif e == n:
            break
        else:
            window *= 2
    return np.array(starts, dtype=np.int64)


def rank_exchange(
    index: Index,
    target: Layout,
    peers: Sequence[int],
    me: int,
    summary: Summary,
    decisions: Decisions,
    chunk_bytes: int,
    positions: SourcePositions,
) -> ExchangePlan:
    """Member ``me``'s part of the exchange plan: the units it reads or needs, their owners, and per unit the parts
    that concern it (``(destination, -1, sub-region)`` for what it sends another member, ``(me, piece position,
    sub-region)`` for what it keeps or receives), in the order plan_exchange lists them; every round, in order,
    with the units of it that concern ``me`` (possibly none: every member takes part in every round)."""
    d = decisions
    mine = np.searchsorted(d.ids, summary.ids) if len(d.ids) else np.zeros(0, np.int64)
    owned = np.flatnonzero(d.owner == me)
    relevant = np.union1d(mine, owned).astype(np.int64)
    own_of = dict(zip(mine.tolist(), range(len(mine))))
    round_of = np.searchsorted(d.round_starts, relevant, side="right") - 1
    rounds: list[list[UnitKey]] = [[] for _ in range(len(d.round_starts))]
    units: dict[UnitKey, list[tuple[int, int, Box]]] = {}
    owner: dict[UnitKey, int] = {}
    chunked: dict[tuple, tuple] = {}
    names = positions.names
    for u, r in zip(relevant.tolist(), round_of.tolist()):
        j = own_of.get(u)
        key = summary.keys[j] if j is not None else _key(index, int(d.ids[u]), int(d.writers[u]), positions)
        o = int(d.owner[u])
        entries: list[tuple[int, int, Box]] = []
        if o != me:
            entries = [(me, pos, sub) for pos, sub in summary.needs[j]] if j is not None else []
        else:
            entry = index.tensors[names[int(d.ids[u]) >> (2 * _BITS)]]
            src = Box.trusted(key[1], key[2])
            for g in d.needers[d.ptr[u] : d.ptr[u + 1]].tolist():
                if g == me:
                    entries += [(me, pos, sub) for pos, sub in summary.needs[j]] if j is not None else []
                else:
                    entries += [
                        (g, -1, sub) for sub in _parts_for(entry, target, peers[g], src, key[4], chunk_bytes, chunked)
                    ]
        units[key] = entries
        owner[key] = o
        rounds[r].append(key)
    return ExchangePlan(units, owner, rounds)


def _parts_for(entry, target: Layout, rank: int, src: Box, chunk: int, chunk_bytes: int, chunked: dict) -> list[Box]:
    """The sub-regions of chunk ``chunk`` of stored piece ``src`` that layout rank ``rank``'s boxes of ``entry``
    take, in the order of its boxes (the order of its plan's pieces): what the owner sends it."""
    out = []
    for box in rank_boxes(entry, target, rank):
        region = src.intersect(box) if box.ndim else src
        if region is None:
            continue
        geo = (src.offsets, src.shape, region.offsets, region.shape, entry.dtype)
        parts = chunked.get(geo)
        if parts is None:
            parts = chunked[geo] = chunks_of(src, region, entry.dtype, chunk_bytes)
        out += [sub for c, sub, _ in parts if c == chunk]
    return out


def gather_summaries(summary: Summary, failed: bool, group) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
    """Every member's ``(ids, nbytes, tags)``, in group rank order (collective over ``group``, a CPU group):
    one all_gather of two integers per member (its count, and whether its planning failed), then one of its
    three integer columns padded to the longest. None, on every member alike, when any member's planning failed
    (the members then agree on the error: :func:`~moeckpt.reshard.load.load_rank_state`)."""
    import torch
    import torch.distributed as dist

    size = dist.get_world_size(group)
    head = torch.tensor([len(summary.ids), int(failed)], dtype=torch.int64)
    heads = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(heads, head, group=group)
    counts = [int(h[0]) for h in heads]
    if any(int(h[1]) for h in heads):
        return None
    longest = max(counts, default=0)
    if not longest:  # nothing needed anywhere (an empty selection): no second gather of empty tensors
        empty = np.zeros(0, np.int64)
        return [(empty, empty, empty) for _ in range(size)]
    buf = torch.zeros((3, longest), dtype=torch.int64)
    n = len(summary.ids)
    for row, column in enumerate((summary.ids, summary.nbytes, summary.tags)):
        buf[row, :n] = torch.from_numpy(np.ascontiguousarray(column, dtype=np.int64))
    bufs = [torch.zeros((3, longest), dtype=torch.int64) for _ in range(size)]
    dist.all_gather(bufs, buf, group=group)
    return [(b[0, :c].numpy(), b[1, :c].numpy(), b[2, :c].numpy()) for b, c in zip(bufs, counts)]
