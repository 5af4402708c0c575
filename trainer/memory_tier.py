"""The in-memory checkpoint tier: checkpoints committed into node-local host memory, replicated to buddy nodes.

A memory checkpoint is an ordinary moeckpt checkpoint (safetensors, one file per writing rank, the same commit
rule: a staging directory renamed into place, the index last) in a node-local directory that outlives the worker
processes: ``<parent>/moeckpt-<run id>/<node>/step-N``, the parent ``/dev/shm`` unless ``--memory-dir`` says
otherwise. The *run id* is a random id kept in the run directory (``memory-tier.json``), so a directory of another
run, or of an earlier run whose run directory was removed and made again, is never taken for this run's.

Every node's step directory holds the files its own ranks wrote and, once replicated, the files of the
``replicas`` nodes before it (node ``i`` sends its part to nodes ``i+1 .. i+replicas`` mod the nodes, over the
checkpoint manager's gloo group, from the node's lowest rank); its index lists *every* file of the step. A node
commits its step directory only after every file of the step is held by ``1 + replicas`` nodes (agreed over the
group), so a committed memory checkpoint survives the loss of any ``replicas`` nodes. A resume lists what every
node holds (:meth:`MemoryTier.holdings`) and takes the newest step whose files the survivors hold between them
(:func:`choose_step`); each file is then read on a node that holds it (``readable`` of
:func:`moeckpt.reshard.load.load_rank_state`).

This is not :mod:`moeckpt.trainer.memory`, the host/device memory *fit check* before a run starts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from moeckpt.formats.backend import Backend, get_backend
from moeckpt.formats.checkpoint import (
    STEP_PREFIX,
    begin_save,
    commit,
    committed_steps,
    replace_files,
    staging_storage,
    step_dir_name,
)
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import INDEX_NAME, FileEntry, Index
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storage import Storage
from moeckpt.formats.storages import open_storage
from moeckpt.reshard import collectives
from moeckpt.reshard.save_protocol import SaveFailedError, SaveHooks, save_collective
from moeckpt.reshard.save_protocol import write_threads as rank_write_threads

from .memory_ring import FORMAT as RING_FORMAT
from .memory_ring import MemoryRing

__all__ = [
    "BACKEND",
    "DEFAULT_PARENT",
    "MARKER",
    "MemoryBudgetError",
    "MemoryChoice",
    "MemorySaveError",
    "MemoryStats",
    "MemoryTier",
    "choose_step",
    "node_name",
    "remove_run_memory",
    "restore_newest",
    "run_id",
    "run_root",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: where memory checkpoints live unless ``--memory-dir`` names another node-local directory.
DEFAULT_PARENT = "/dev/shm"
#: ``0`` turns the memory ring off (:meth:`MemoryTier.open_ring`): the tier then writes copies, as before the ring.
RING_ENV = "MOECKPT_MEMORY_RING"
#: the run directory's record of its run id.
MARKER = "memory-tier.json"
#: the memory tier's default file format. Any backend that stores each writer's pieces in files of its own
#: (``stores_placements``, ``writer_of``) will do: a node's holdings are then a set of writers.
BACKEND = "safetensors"


class MemoryBudgetError(MoeckptError, ValueError):
    """The memory directory's filesystem cannot hold ``--memory-keep`` memory checkpoints."""


class MemorySaveError(SaveFailedError):
    """A memory checkpoint could not be written or replicated on some rank; it was not committed (a
    :class:`~moeckpt.reshard.save_protocol.SaveFailedError`, so ``except moeckpt.SaveFailedError`` catches it)."""


@dataclass
class MemoryStats:
    """One memory save: the seconds it took, the bytes this rank wrote, sent and received, and whether it
    committed."""

    step: int
    seconds: float = 0.0
    bytes_written: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    committed: bool = False
    error: str | None = None


@dataclass
class MemoryChoice:
    """The memory checkpoint a resume takes: its step, and which writers' files each node holds."""

    step: int
    #: node key -> the writer ranks whose files that node's directory holds.
    writers: dict[str, set[int]] = field(default_factory=dict)
    #: bytes of the step's files, each counted once.
    nbytes: int = 0


def node_name() -> str:
    """This node's name: ``$MOECKPT_NODE`` (several simulated nodes on one host), else the host name."""
    name = os.environ.get("MOECKPT_NODE") or socket.gethostname() or "node"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def run_id(run_dir: str, *, create: bool) -> str | None:
    """The run's id, kept in ``run_dir/memory-tier.json`` (made with a fresh random id when ``create``)."""
    storage = open_storage(run_dir)
    try:
        value = json.loads(storage.read_bytes(MARKER)).get("run_id")
        if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{8,64}", value):
            return value
    except FileNotFoundError:
        pass  # no marker yet: a new run, given an id below
    except ValueError:
        log.warning(
            "%s: unreadable, giving the run a new id (older memory checkpoints are ignored)", storage.path(MARKER)
        )
    if not create:
        return None
    value = uuid.uuid4().hex[:16]
    storage.makedirs()
    storage.write_bytes(MARKER, json.dumps({"run_id": value}).encode())
    return value


def run_root(parent: str | None, rid: str) -> str:
    """The directory of one run's memory checkpoints under ``parent`` (default ``/dev/shm``)."""
    return os.path.join(parent or DEFAULT_PARENT, f"moeckpt-{rid}")


def remove_run_memory(run_dir: str, parent: str | None = None) -> str | None:
    """Remove this host's memory checkpoints of the run at ``run_dir`` (``moeckpt gc``); the directory removed."""
    rid = run_id(run_dir, create=False)
    if rid is None:
        return None
    root = run_root(parent, rid)
    if not os.path.isdir(root):
        return None
    shutil.rmtree(root, ignore_errors=True)
    return root


def check_host_budget(
    run_dir: str, parent: str | None, *, keep: int, replicas: int, state_bytes: int, ranks_here: int, world: int
) -> int:
    """Before any worker starts: refuse (:class:`MemoryBudgetError`) a host whose memory directory cannot hold
    ``keep`` memory checkpoints of its ``ranks_here`` ranks' share of a ``world``-rank job (and of its buddies'
    shares); the run's own memory checkpoints there count as free. Returns the bytes needed."""
    nodes = max(1, world // max(1, ranks_here))
    need = int(keep * state_bytes * ranks_here / max(1, world) * (1 + min(replicas, nodes - 1)))
    where = parent or DEFAULT_PARENT
    rid = run_id(run_dir, create=False)
    held = _tree_bytes(run_root(parent, rid)) if rid is not None and os.path.isdir(run_root(parent, rid)) else 0
    free = _free_bytes(where) + held
    if free < need:
        raise MemoryBudgetError(
            f"--memory-keep {keep}: {keep} memory checkpoint(s) need {need / 1e6:.1f} MB on this node in a world of "
            f"{world}, {where} has {free / 1e6:.1f} MB free; lower --memory-keep or --memory-replicas, or point "
            "--memory-dir at a larger node-local filesystem"
        )
    return need


def _free_bytes(path: str) -> int:
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


class MemoryTier:
    """One rank's view of the memory tier; constructed collectively (over ``group``) by every rank.

    ``state_bytes`` (every logical tensor's bytes, written once) sizes the budget: a node keeps ``keep``
    checkpoints of its ranks' share and of its buddies' shares.
    """

    def __init__(self, root: str, *, group, keep: int, replicas: int, state_bytes: int, backend: str = BACKEND) -> None:
        self.root = root
        self.backend_name = backend
        self.backend: Backend = get_backend(backend)
        if not self.backend.stores_placements:
            raise MoeckptError(
                f"the memory tier cannot keep {backend} checkpoints: a node's holdings must be whole writers' files "
                "(a backend that stores placements, such as safetensors)"
            )
        self.group = group
        self.keep = keep
        self.node = node_name()
        self.node_dir = os.path.join(root, self.node)
        self.rank = collectives.rank()
        world = collectives.world_size()
        # Ranks sharing a node directory are one node (on one host, nodes differ by $MOECKPT_NODE or --memory-dir).
        keys = collectives.all_gather_json(self.node_dir, group)
        self.nodes: list[str] = list(dict.fromkeys(keys))
        self.ranks_of: dict[str, list[int]] = {n: [r for r, k in enumerate(keys) if k == n] for n in self.nodes}
        self.leaders = [self.ranks_of[n][0] for n in self.nodes]
        self.key = self.node_dir
        #: every rank's node key, in rank order.
        self.keys: list[str] = keys
        self.node_index = self.nodes.index(self.key)
        self.is_leader = self.ranks_of[self.key][0] == self.rank
        self.replicas = min(replicas, len(self.nodes) - 1)
        if replicas > self.replicas and self.rank == 0:
            log.info(
                "--memory-replicas %d: only %d other node(s) in this world, keeping %d replica(s)",
                replicas,
                len(self.nodes) - 1,
                self.replicas,
            )
        share = state_bytes * len(self.ranks_of[self.key]) / max(1, world)
        #: the node's memory checkpoints, and the memory ring's spare slot (:meth:`open_ring`).
        self.budget_bytes = int(keep * share * (1 + self.replicas) + share)
        #: this rank's ring of slot files (:mod:`.memory_ring`), opened by the checkpoint manager.
        self.ring: MemoryRing | None = None
        self.ring_dir = os.path.join(root, f"{self.node}.ring")

    def open_ring(self, rank: int, layout, tensors, *, pin: bool) -> MemoryRing | None:
        """Open this rank's memory ring for its written ``layout`` (``(tensor, box)`` in snapshot order): the
        files the snapshots land in and the memory checkpoints are made of, ``keep + 1`` slots (the spare one
        for a persistent save reading a slot); mapped from a previous process's files where they survive. Only
        for the ring's format and unless ``$MOECKPT_MEMORY_RING=0``; ``None`` otherwise (the tier writes copies)."""
        if self.backend_name != RING_FORMAT or os.environ.get(RING_ENV) == "0":
            return None
        self.ring = MemoryRing(
            os.path.join(self.ring_dir, f"rank-{rank:05d}"),
            rank,
            layout,
            tensors,
            slots=max(2, self.keep + 1),
            pin=pin,
            node_dir=self.node_dir,
        )
        return self.ring

    # -- budget ---------------------------------------------------------------------------------------------
    def check_budget(self) -> None:
        """Refuse, on every rank alike, a node whose filesystem cannot hold the budget (its own old checkpoints
        count as free); rank 0 logs the budget."""
        held = sum(_tree_bytes(os.path.join(self.node_dir, n)) for n in _listdir(self.node_dir))
        free = _free_bytes(self.node_dir) + held
        if self.rank == 0:
            log.info(
                "memory tier: %d checkpoint(s) per node in %s, about %.1f MB on this node (%.1f MB free)",
                self.keep,
                self.root,
                self.budget_bytes / 1e6,
                free / 1e6,
            )
        error = None
        if free < self.budget_bytes:
            error = (
                f"--memory-keep {self.keep}: {self.keep} memory checkpoint(s) need {self.budget_bytes / 1e6:.1f} "
                f"MB on node {self.node}, {os.path.dirname(self.root)} has {free / 1e6:.1f} MB free; lower "
                "--memory-keep or --memory-replicas, or point --memory-dir at a larger node-local filesystem"
            )
        errors = [e for e in collectives.all_gather_json(error, self.group) if e]
        if errors:
            raise MemoryBudgetError(errors[0])

    # -- writing --------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        pieces: list[Piece],
        *,
        tensors,
        layout_json: dict,
        model: dict,
        train_state: dict[str, Any],
        slot: int | None = None,
    ) -> MemoryStats:
        """Write this rank's pieces into its node's ``step-N``, replicate the node's part to its buddies and
        commit every node's directory once every file has its replicas (collective over the group).

        The engine's save protocol (:func:`~moeckpt.reshard.save_protocol.save_collective`) with one location per
        node, its leader the coordinator: the leader prunes before it begins, and the replication runs between the
        exchange of what was written and the commit. A failure is a :class:`MemorySaveError` on every rank (or, at
        the start, the format layer's own error class, e.g. a destination that is not empty).

        With ``slot`` (of :attr:`ring`, which the snapshot landed in) this rank's file is that slot: hashed off the
        training thread, its header written in place and linked into the step, no byte copied."""
        t0 = time.perf_counter()
        stats = MemoryStats(step=step)
        location = self.location(step)
        index = Index(
            backend=self.backend_name,
            step=step,
            layout=layout_json,
            model=model,
            tensors=tensors,
            files={},
            train_state=train_state,
        )

        def written(files: list[FileEntry]) -> None:
            stats.bytes_written = sum(f.size for f in files)

        save_collective(
            location,
            index,
            pieces,
            group=self.group,
            replace_uncommitted=True,
            backend=self.backend if slot is None or self.ring is None else _RingWriter(self.ring, slot, self.backend),
            threads=write_threads(),
            coordinator=self.is_leader,
            hooks=SaveHooks(
                before_begin=lambda: self._begin(step),
                after_write=written,
                before_commit=lambda by_rank: self._replicate(location, by_rank, stats),
            ),
            failure=MemorySaveError,
            commit_log_level=logging.DEBUG,
        )
        stats.committed = True
        if slot is not None and self.ring is not None:
            self.ring.committed(slot, step)
        stats.seconds = time.perf_counter() - t0
        log.debug("memory checkpoint of step %d committed in %s (%.2f s)", step, location, stats.seconds)
        return stats

    def _agree(self, error: str | None) -> None:
        errors = [e for e in collectives.all_gather_json(error, self.group) if e]
        if errors:
            raise MemorySaveError("; ".join(errors))

    def _replicate(self, location: str, by_rank: list[list[FileEntry]], stats: MemoryStats) -> None:
        """Send this node's files to its ``replicas`` buddies, receive the files of the nodes it is buddy of.

        One round per distance ``d``: node ``i``'s leader sends to node ``i+d``'s and receives from ``i-d``'s;
        the other ranks only take part in the agreement. Then every file must be held by ``1 + replicas`` nodes.
        """
        staging = staging_storage(location)
        n = len(self.nodes)
        for d in range(1, self.replicas + 1):
            error = None
            if self.is_leader:
                try:
                    dst = self.leaders[(self.node_index + d) % n]
                    src_node = self.nodes[(self.node_index - d) % n]
                    src = self.leaders[(self.node_index - d) % n]
                    mine = [f for r in self.ranks_of[self.key] for f in by_rank[r]]
                    theirs = [f for r in self.ranks_of[src_node] for f in by_rank[r]]
                    payload = _pack(staging, mine)
                    incoming = torch.empty(sum(f.size for f in theirs), dtype=torch.uint8)
                    ops = [
                        dist.P2POp(dist.isend, payload, dst, self.group),
                        dist.P2POp(dist.irecv, incoming, src, self.group),
                    ]
                    for req in dist.batch_isend_irecv(ops):
                        req.wait()
                    stats.bytes_sent += payload.numel()
                    stats.bytes_received += incoming.numel()
                    offset = 0
                    raw = incoming.numpy()
                    for f in theirs:
                        staging.write_parts(f.path, [raw[offset : offset + f.size].data], fsync=False)
                        offset += f.size
                except Exception as e:  # noqa: BLE001 - shared below
                    error = f"node {self.node}: replication at distance {d} failed: {e}"
            self._agree(error)

    def _begin(self, step: int) -> None:
        """Before a memory save of ``step`` (leader): this node's copies of ``step`` and later steps are from before
        a resume that went back (the run's step only grows otherwise), so they make way for the new ones; then the
        budget is kept (:meth:`_prune`)."""
        stale = [s for s, _ in committed_steps(self.node_dir) if s >= step] if os.path.isdir(self.node_dir) else []
        if stale:
            log.info(
                "memory checkpoint(s) of step(s) %s on node %s are from before the resume (the run is at step %d "
                "again): removed, the new ones take their place",
                ", ".join(map(str, stale)),
                self.node,
                step,
            )
            for s in stale:
                shutil.rmtree(self.location(s), ignore_errors=True)
        self._prune(self.keep - 1)

    def _prune(self, keep: int) -> None:
        """Keep this node's ``keep`` newest committed memory checkpoints; remove older ones and leftovers."""
        steps = [
            int(n[len(STEP_PREFIX) :])
            for n in _listdir(self.node_dir)
            if n.startswith(STEP_PREFIX)
            and n[len(STEP_PREFIX) :].isdigit()
            and os.path.exists(os.path.join(self.node_dir, n, INDEX_NAME))
        ]
        for step in sorted(steps)[: max(0, len(steps) - keep)]:
            shutil.rmtree(os.path.join(self.node_dir, step_dir_name(step)), ignore_errors=True)
        for name in _listdir(self.node_dir):
            if name.startswith("."):  # a torn save's staging directory, an old checkpoint being replaced
                shutil.rmtree(os.path.join(self.node_dir, name), ignore_errors=True)

    # -- resuming -------------------------------------------------------------------------------------------
    def holdings(self) -> dict[str, Any]:
        """What this node holds: ``{step: {"files": {path: size} held, "need": [every file of the step],
        "writers": [the writers whose files those are]}}`` of its committed memory checkpoints (an index that does
        not parse is skipped)."""
        out: dict[str, Any] = {}
        if not os.path.isdir(self.node_dir):
            return out
        for step, st in committed_steps(self.node_dir):
            try:
                index = Index.loads(st.read_bytes(INDEX_NAME), st.path(INDEX_NAME))
            except (MoeckptError, OSError, ValueError) as e:
                log.warning("memory checkpoint %s: unreadable index (%s), ignored", st.location, e)
                continue
            present = set(_listdir(st.location))
            held = {p: f.size for p, f in index.files.items() if p in present}
            writers = sorted(w for w in map(self.backend.writer_of, held) if w is not None)
            out[str(step)] = {"files": held, "need": sorted(index.files), "writers": writers}
        return out

    def location(self, step: int) -> str:
        return os.path.join(self.node_dir, step_dir_name(step))

    def gather(self) -> dict[str, dict[str, Any]]:
        """Every node's :meth:`holdings`, by node key (collective)."""
        everyone = collectives.all_gather_json([self.key, self.holdings() if self.is_leader else None], self.group)
        return {key: held for key, held in everyone if held is not None}

    def ensure_index(self, step: int, index_bytes: bytes | None) -> None:
        """A node that holds none of ``step``'s files gets its index (committed, no data), so its ranks can plan
        the load and read the files elsewhere (leader only; the caller synchronises)."""
        location = self.location(step)
        if index_bytes is None or os.path.exists(os.path.join(location, INDEX_NAME)):
            return
        begin_save(location, replace_uncommitted=True)
        commit(location, Index.loads(index_bytes, location))

    def check_copy(self, step: int) -> list[str]:
        """The problems of this node's copy of ``step`` (leader only): every file it holds read back whole, its
        size and every piece's checksums; a file the node does not hold is not its problem. Empty: intact."""
        location = self.location(step)
        storage = open_storage(location)
        try:
            index = Index.loads(storage.read_bytes(INDEX_NAME), storage.path(INDEX_NAME))
        except (MoeckptError, OSError, ValueError) as e:
            return [f"{INDEX_NAME}: {e}"]
        present = set(_listdir(location))
        problems = []
        for path, entry in index.files.items():
            if path not in present:
                continue
            size = os.path.getsize(os.path.join(location, path))
            if size != entry.size:
                problems.append(f"{path}: {size} bytes, the index says {entry.size}")
                continue
            try:
                for ref in self.backend.list_pieces(storage, replace_files(index, [entry])):
                    self.backend.read_piece(storage, ref)
            except (MoeckptError, OSError) as e:
                problems.append(f"{path}: {e}")
        return problems

    def reject(self, step: int, why: str) -> str | None:
        """Move this node's copy of ``step`` aside (leader only), so no resume takes it and the next save of that
        step can be committed in its place; the next memory save removes it (host memory is the budget). Returns
        where it went, ``None`` when the node held no copy."""
        location = self.location(step)
        if not os.path.isdir(location):
            return None
        aside = os.path.join(self.node_dir, f".rejected-{step_dir_name(step)}-{uuid.uuid4().hex[:8]}")
        os.rename(location, aside)
        log.warning(
            "memory checkpoint of step %d on node %s rejected (%s): moved aside to %s, removed at the next memory save",
            step,
            self.node,
            why,
            aside,
        )
        return aside

    def remove_all(self) -> None:
        """The run ended normally: remove this node's memory checkpoints (collective)."""
        collectives.barrier(self.group)
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        collectives.barrier(self.group)
        if self.is_leader:
            shutil.rmtree(self.node_dir, ignore_errors=True)
            shutil.rmtree(self.ring_dir, ignore_errors=True)
            try:
                os.rmdir(self.root)  # the last node of the host removes the run's directory
            except OSError:
                pass  # not empty: another node of this host still holds its checkpoints there


#: the most threads a rank writes its memory checkpoint with: in memory one thread hashing and copying the state
#: (a page fault per new page) is the limit, not a disk.
MEMORY_WRITE_THREADS = 8


def write_threads() -> int:
    """Threads a rank writes its memory checkpoint with: its share of the node's cores, at most
    :data:`MEMORY_WRITE_THREADS` (:func:`moeckpt.reshard.save_protocol.write_threads`)."""
    return rank_write_threads(most=MEMORY_WRITE_THREADS)


def choose_step(held: dict[str, dict[str, Any]], *, not_before: int | None) -> MemoryChoice | None:
    """The newest step whose every file some node in ``held`` (:meth:`MemoryTier.gather`) holds, if it is at
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


def _pack(staging: Storage, files: list[FileEntry]) -> torch.Tensor:
    """This node's files, end to end in one buffer to send; read one file at a time, so the node holds one
    file's bytes more than the buffer at most."""
    out = torch.empty(sum(f.size for f in files), dtype=torch.uint8)
    offset = 0
    for f in files:
        data = staging.read_bytes(f.path)
        if len(data) != f.size:
            raise MemorySaveError(f"{staging.path(f.path)}: {len(data)} bytes, {f.size} were written")
        if data:
            out[offset : offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset += len(data)
    return out


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []


def _tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(dirpath, n)) for n in names)
    return total


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
    Then each node checks its own copy of that step (:meth:`MemoryTier.check_copy`), a damaged copy is moved
    aside (:meth:`MemoryTier.reject`; every copy, if none of them shows why) and the choice is made again, so the
    fallback order is: the same step from the other nodes' replicas, then the newest older memory step that is
    complete and not older than ``not_before``, then storage. Each turn is logged with its reason, and
    ``on_rejected(step, error, {node: problems})`` runs on rank 0 for each rejection (the trainer's metrics).
    """
    from .resume import DAMAGED_CHECKPOINT_ERRORS

    rank = collectives.rank(group)
    rejected: dict[int, list[str]] = {}  # step -> the nodes whose copy was set aside
    while True:
        held = tier.gather()
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
            problems = tier.check_copy(step) if tier.is_leader and os.path.isdir(tier.location(step)) else []
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
                tier.reject(step, "; ".join(bad[tier.key]))
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
        tier.ensure_index(step, text.encode())
    collectives.barrier(group)


class _RingWriter:
    """The backend a memory save with a ring slot writes through: this rank's file is the slot (hashed, its header
    written in place, linked into the staging directory); the rest is the tier's backend."""

    def __init__(self, ring: MemoryRing, slot: int, backend: Backend) -> None:
        self.ring, self.slot, self.backend = ring, slot, backend

    def prepare(self, storage: Storage, tensors, boxes) -> None:
        self.backend.prepare(storage, tensors, boxes)

    def write(self, storage: Storage, writer: int, pieces, tensors, *, threads: int = 1) -> list[FileEntry]:
        del writer, tensors  # the ring's own: this rank's layout
        entry = self.ring.finish(self.slot, pieces, threads=threads)
        self.ring.link(self.slot, storage.path())
        return [entry]

    def finish(self, storage: Storage, files: list[FileEntry], tensors) -> list[FileEntry]:
        return self.backend.finish(storage, files, tensors)
