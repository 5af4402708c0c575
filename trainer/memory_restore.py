"""The memory tier's restore side: what each node holds (:func:`holdings`, gathered by :func:`gather`), the
newest step the survivors hold between them (:func:`choose_step`), and the resume from it with its fallback order
(:func:`restore_newest`): a damaged copy checked (:func:`check_copy`) and set aside (:func:`reject`), then the same
step from the other nodes' replicas, an older complete memory step, then storage.

Writing memory checkpoints is :mod:`.memory_tier`'s; sending them to buddy nodes is :mod:`.memory_replicas`'.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moeckpt.formats.checkpoint import begin_save, commit, committed_steps, replace_files, step_dir_name
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import INDEX_NAME, Index
from moeckpt.formats.storages import open_storage
from moeckpt.reshard import collectives

from .memory_tier import MemoryTier, listdir_sorted

__all__ = [
    "MemoryChoice",
    "check_copy",
    "choose_step",
    "ensure_index",
    "gather",
    "holdings",
    "reject",
    "restore_newest",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class MemoryChoice:
    """The memory checkpoint a resume takes: its step, and which writers' files each node holds."""

    step: int
    #: node key -> the writer ranks whose files that node's directory holds.
    writers: dict[str, set[int]] = field(default_factory=dict)
    #: bytes of the step's files, each counted once.
    nbytes: int = 0


def holdings(tier: MemoryTier) -> dict[str, Any]:
    """What this node holds: ``{step: {"files": {path: size} held, "need": [every file of the step],
    "writers": [the writers whose files those are]}}`` of its committed memory checkpoints (an index that does
    not parse is skipped)."""
    out: dict[str, Any] = {}
    if not os.path.isdir(tier.node_dir):
        return out
    for step, st in committed_steps(tier.node_dir):
        try:
            index = Index.loads(st.read_bytes(INDEX_NAME), st.path(INDEX_NAME))
        except (MoeckptError, OSError, ValueError) as e:
            log.warning("memory checkpoint %s: unreadable index (%s), ignored", st.location, e)
            continue
        present = set(listdir_sorted(st.location))
        held = {p: f.size for p, f in index.files.items() if p in present}
        writers = sorted(w for w in map(tier.backend.writer_of, held) if w is not None)
        out[str(step)] = {"files": held, "need": sorted(index.files), "writers": writers}
    return out


def gather(tier: MemoryTier) -> dict[str, dict[str, Any]]:
    """Every node's :func:`holdings`, by node key (collective)."""
    everyone = collectives.all_gather_json([tier.key, holdings(tier) if tier.is_leader else None], tier.group)
    return {key: held for key, held in everyone if held is not None}


def ensure_index(tier: MemoryTier, step: int, index_bytes: bytes | None) -> None:
    """A node that holds none of ``step``'s files gets its index (committed, no data), so its ranks can plan
    the load and read the files elsewhere (leader only; the caller synchronises)."""
    location = tier.location(step)
    if index_bytes is None or os.path.exists(os.path.join(location, INDEX_NAME)):
        return
    begin_save(location, replace_uncommitted=True)
    commit(location, Index.loads(index_bytes, location))


def check_copy(tier: MemoryTier, step: int) -> list[str]:
    """The problems of this node's copy of ``step`` (leader only): every file it holds read back whole, its
    size and every piece's checksums; a file the node does not hold is not its problem. Empty: intact."""
    location = tier.location(step)
    storage = open_storage(location)
    try:
        index = Index.loads(storage.read_bytes(INDEX_NAME), storage.path(INDEX_NAME))
    except (MoeckptError, OSError, ValueError) as e:
        return [f"{INDEX_NAME}: {e}"]
    present = set(listdir_sorted(location))
    problems = []
    for path, entry in index.files.items():
        if path not in present:
            continue
        size = os.path.getsize(os.path.join(location, path))
        if size != entry.size:
            problems.append(f"{path}: {size} bytes, the index says {entry.size}")
            continue
        try:
            for ref in tier.backend.list_pieces(storage, replace_files(index, [entry])):
                tier.backend.read_piece(storage, ref)
        except (MoeckptError, OSError) as e:
            problems.append(f"{path}: {e}")
    return problems


def reject(tier: MemoryTier, step: int, why: str) -> str | None:
    """Move this node's copy of ``step`` aside (leader only), so no resume takes it and the next save of that
    step can be committed in its place; the next memory save removes it (host memory is the budget). Returns
    where it went, ``None`` when the node held no copy."""
    location = tier.location(step)
    if not os.path.isdir(location):
        return None
    aside = os.path.join(tier.node_dir, f".rejected-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
    os.rename(location, aside)
    log.warning(
        "memory checkpoint of step %d on node %s rejected (%s): moved aside to %s, removed at the next memory save",
        step,
        tier.node,
        why,
        aside,
    )
    return aside


def choose_step(held: dict[str, dict[str, Any]], *, not_before: int | None) -> MemoryChoice | None:
    """The newest step whose every file some node in ``held`` (:func:`gather`) holds, if it is at
    least ``not_before`` (the newest persisted step); else ``None``."""
    steps = sorted({int(s) for h in held.values() for s in h}, reverse=True)
    for step in steps:
        if not_before is not None and step < not_before:
            break
        need: set[str] = set()
        have: dict[str, int] = {}
        writers: dict[str, set[int]] = {}
        for key, h in held.items():
            entry = h.get(str(step))
            if entry is None:
                writers[key] = set()
                continue
            need |= set(entry["need"])
            have.update(entry["files"])
            writers[key] = set(entry.get("writers", ()))
        if need and need <= set(have):
            return MemoryChoice(step=step, writers=writers, nbytes=sum(have[p] for p in need))
    return None


def restore_newest(
    tier: MemoryTier,
    load: Callable[[str, list[set[int]] | None], T],
    *,
    not_before: int | None,
    group,
    on_rejected: Callable[[int, str, dict[str, list[str]]], None] | None = None,
) -> T | None:
    """Load the newest memory checkpoint the nodes of this world hold between them, if it is not older than
    ``not_before`` (the newest persisted step); ``None`` when none is left, for the caller to resume from storage.
    Collective over ``group`` (the whole world).

    ``load(location, readable)`` reads the checkpoint at ``location`` (``readable``: per rank, the writers whose
    files its node holds; ``None`` when every node holds every file) and raises
    :data:`~moeckpt.trainer.resume.DAMAGED_CHECKPOINT_ERRORS` for a copy that fails its checksums or is short.
    Then each node checks its own copy of that step (:func:`check_copy`), a damaged copy is moved
    aside (:func:`reject`; every copy, if none of them shows why) and the choice is made again, so the
    fallback order is: the same step from the other nodes' replicas, then the newest older memory step that is
    complete and not older than ``not_before``, then storage. Each turn is logged with its reason, and
    ``on_rejected(step, error, {node: problems})`` runs on rank 0 for each rejection (the trainer's metrics).
    """
    from .resume import DAMAGED_CHECKPOINT_ERRORS

    rank = collectives.rank(group)
    rejected: dict[int, list[str]] = {}  # step -> the nodes whose copy was set aside
    while True:
        held = gather(tier)
        choice = choose_step(held, not_before=not_before)
        after = f"after setting aside {_rejections(rejected)}" if rejected else ""
        if choice is None:
            if rejected and rank == 0:
                newest = "none is persisted" if not_before is None else f"the newest persisted one is {not_before}"
                log.warning(
                    "no complete memory checkpoint at or after the newest persisted step is left %s (%s): resuming "
                    "from storage",
                    after,
                    newest,
                )
            return None
        step = choice.step
        if rejected and rank == 0:
            if step in rejected:
                holders = [_node_of(k) for k, w in choice.writers.items() if w]
                log.warning(
                    "resuming memory step %d from the copies on node(s) %s %s: every file of it is still held intact",
                    step,
                    ", ".join(holders),
                    after,
                )
            else:
                floor = "" if not_before is None else f", at or after the newest persisted step {not_before}"
                log.warning(
                    "memory step(s) %s incomplete %s: resuming from memory step %d, the newest complete one%s",
                    ", ".join(map(str, sorted(rejected, reverse=True))),
                    after,
                    step,
                    floor,
                )
        _share_index(tier, step, held, group)
        readable: list[set[int]] | None = [choice.writers.get(key, set()) for key in tier.keys]
        everything = set().union(*readable) if readable else set()
        if readable and all(r == everything for r in readable):
            # Every rank's node holds every file (one node, or replicas everywhere): no read needs routing, so the
            # load takes its usual path (each rank alone, straight into its tensors, on a GPU through pinned
            # staging) instead of the routed exchange.
            readable = None
        try:
            return load(tier.location(step), readable)
        except DAMAGED_CHECKPOINT_ERRORS as e:
            problems = check_copy(tier, step) if tier.is_leader and os.path.isdir(tier.location(step)) else []
            everyone = collectives.all_gather_json([tier.key, problems if tier.is_leader else None], group)
            bad = {key: p for key, p in everyone if p}
            if not bad:
                # The load failed but no copy shows why on its own (a file read on another node than the one that
                # checked it changed since): set every copy aside, so the next choice is another step.
                bad = {
                    key: [f"the load failed and no copy's own check shows why: {e}"]
                    for key, h in held.items()
                    if str(step) in h
                }
            if tier.is_leader and tier.key in bad:
                reject(tier, step, "; ".join(bad[tier.key]))
            collectives.barrier(group)
            rejected.setdefault(step, []).extend(_node_of(k) for k in bad)
            if rank == 0 and on_rejected is not None:
                on_rejected(step, str(e), {_node_of(k): p for k, p in bad.items()})


def _node_of(key: str) -> str:
    """A node's name from its key (its memory directory)."""
    return os.path.basename(key.rstrip("/"))


def _rejections(rejected: dict[int, list[str]]) -> str:
    return "; ".join(f"step {s} on node(s) {', '.join(sorted(set(n)))}" for s, n in sorted(rejected.items()))


def _share_index(tier: MemoryTier, step: int, held: dict[str, dict[str, Any]], group) -> None:
    """A node that holds none of ``step``'s files gets its index (committed, no data), so its ranks can plan the
    load and read the files elsewhere (collective)."""
    having = [key for key in tier.nodes if str(step) in held.get(key, {})]
    if len(having) == len(tier.nodes):
        return
    src = tier.ranks_of[having[0]][0]
    text = None
    if collectives.rank(group) == src:
        with open(os.path.join(tier.location(step), INDEX_NAME), encoding="utf-8") as f:
            text = f.read()
    text = collectives.broadcast_json(text, src, group)
    if tier.is_leader:
        ensure_index(tier, step, text.encode())
    collectives.barrier(group)
