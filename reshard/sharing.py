"""Offline writers that read the same stored chunks, grouped so that each stored byte is read once.

A layout change makes several target writers need rows of one stored piece: a TP split along dim 1 gives each
new TP rank a column range of every row, a new ZeRO split cuts an old part between two new ones. Written one
after the other, or in different processes, each writer fetches those chunks again (1.98x the source bytes at
tp 1 -> 2, docs/benchmarks/README.md). Writers that share chunks therefore run together, in threads of one
process over one chunk cache that keeps each chunk until its last planned reader took it
(:meth:`~moeckpt.reshard.chunks.ChunkReader.expect`).

A group is not capped by writers: a chain of ZeRO re-splits over many dp ranks (uneven dp with a TP or EP change)
links every writer through the stored pieces smaller than one chunk, which each writer reads whole, and a group
cut anywhere has every such piece on its cut read again by both sides (docs/benchmarks/README.md). The executor
runs at most :data:`GROUP_THREADS` of a group's writers at once, the next starting as one ends, so a long chain
costs threads and memory like a short one; the chunks a running writer shares with one still to start stay
pinned in the cache until that one takes them, within the cache's hard cap.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from .plan import RankPlan, ReadItem

#: at most this many writers of one group run at once (threads of its process, in rank order): a group's memory
#: (a slab and a write batch per running writer) stays that of this many writers, however long the chain.
GROUP_THREADS = 8
#: two writers always run together when they share at least this fraction of the smaller one's reads (a TP split
#: along dim 1: all of them); writers that share less (the chunks at a ZeRO cut) run together only while there
#: are more groups than worker processes, or while the chunks read by several groups exceed :data:`REREAD_SHARE`
#: of all reads, so a reshard keeps its parallelism for the price of a few chunks.
STRONG_SHARE = 1 / 8
#: the most bytes, as a share of the bytes read, that writers in different groups may read again.
REREAD_SHARE = 0.03


def sharing_groups(
    ranks: Sequence[RankPlan],
    chunks_of: Callable[[ReadItem], Iterable[tuple[Hashable, int]]],
    workers: int,
) -> list[list[RankPlan]]:
    """``ranks`` in groups of writers that read common chunks, each in rank order.

    ``chunks_of(item)`` lists ``(chunk, bytes)`` for every chunk a read touches. Writer pairs are joined by the
    bytes they share, most first: always when they share :data:`STRONG_SHARE` of the smaller one's reads, else
    while there are more than ``workers`` groups or the bytes read again exceed :data:`REREAD_SHARE`.
    """
    readers: dict[Hashable, set[int]] = {}
    size: dict[Hashable, int] = {}
    for i, rank_plan in enumerate(ranks):
        for piece in rank_plan.pieces:
            for item in piece.reads:
                for key, nbytes in chunks_of(item):
                    readers.setdefault(key, set()).add(i)
                    size[key] = nbytes
    reads = [0] * len(ranks)
    shared: dict[tuple[int, int], int] = {}
    for key, who in readers.items():
        for i in who:
            reads[i] += size[key]
        if len(who) > 1:
            ids = sorted(who)
            for a in range(len(ids)):
                for b in range(a + 1, len(ids)):
                    pair = (ids[a], ids[b])
                    shared[pair] = shared.get(pair, 0) + size[key]

    parent = list(range(len(ranks)))
    members = {i: [i] for i in range(len(ranks))}
    total = sum(size.values())
    reread = sum(shared.values())  # bytes read again across groups (counted by pairs: an upper bound)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    groups = len(ranks)
    for (i, j), nbytes in sorted(shared.items(), key=lambda kv: (-kv[1], kv[0])):
        a, b = root(i), root(j)
        if a == b:
            continue
        weak = nbytes < STRONG_SHARE * min(reads[i], reads[j])
        if weak and groups <= workers and reread <= REREAD_SHARE * total:
            continue
        for u in members[a]:
            for v in members[b]:
                reread -= shared.get((min(u, v), max(u, v)), 0)
        parent[max(a, b)] = min(a, b)
        members[min(a, b)] += members.pop(max(a, b))
        groups -= 1
    by_root: dict[int, list[int]] = {}
    for i in range(len(ranks)):
        by_root.setdefault(root(i), []).append(i)
    return [[ranks[i] for i in ids] for ids in sorted(by_root.values())]
