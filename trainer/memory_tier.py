"""The in-memory checkpoint tier: checkpoints committed into node-local host memory, replicated to buddy nodes.

A memory checkpoint is an ordinary moeckpt checkpoint (safetensors, one file per writing rank, the same commit
rule: a staging directory renamed into place, the index last) in a node-local directory that outlives the worker
processes: ``<parent>/moeckpt-<run id>/<node>/step-N``, the parent ``/dev/shm`` unless ``--memory-dir`` says
otherwise. The *run id* is a random id kept in the run directory (``memory-tier.json``), so a directory of another
run, or of an earlier run whose run directory was removed and made again, is never taken for this run's.

Every node's step directory holds the files its own ranks wrote and, once replicated, the files of the
``replicas`` nodes before it (node ``i`` sends its part to nodes ``i+1 .. i+replicas`` mod the nodes, over the
checkpoint manager's gloo group, from the node's lowest rank: :mod:`.memory_replicas`); its index lists *every*
file of the step. A node commits its step directory only after every file of the step is held by ``1 + replicas``
nodes (agreed over the group), so a committed memory checkpoint survives the loss of any ``replicas`` nodes.
A resume lists what every node holds and takes the newest step whose files the survivors hold between them; each
file is then read on a node that holds it (``readable`` of :func:`moeckpt.reshard.load.load_rank_state`): that
side is :mod:`.memory_restore`'s. This module is the tier itself: its nodes, run id and budget, and the writing and
pruning of memory checkpoints.

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
from dataclasses import dataclass
from typing import Any

from moeckpt.formats.backend import Backend, get_backend
from moeckpt.formats.checkpoint import (
    STEP_PREFIX,
    committed_steps,
    step_dir_name,
)
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import INDEX_NAME, FileEntry, Index
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storages import open_storage
from moeckpt.reshard import collectives
from moeckpt.reshard.save_protocol import SaveFailedError, SaveHooks, save_collective
from moeckpt.reshard.save_protocol import write_threads as rank_write_threads

from .memory import MemoryBudgetError
from .memory_replicas import replicate
from .memory_ring import FORMAT as RING_FORMAT
from .memory_ring import MemoryRing, RingWriter

__all__ = [
    "BACKEND",
    "DEFAULT_PARENT",
    "MARKER",
    "MemoryBudgetError",
    "MemorySaveError",
    "MemoryStats",
    "MemoryTier",
    "listdir_sorted",
    "node_name",
    "remove_run_memory",
    "run_id",
    "run_root",
]

log = logging.getLogger(__name__)

#: where memory checkpoints live unless ``--memory-dir`` names another node-local directory.
DEFAULT_PARENT = "/dev/shm"
#: ``0`` turns the memory ring off (:meth:`MemoryTier.open_ring`): the tier then writes copies, as before the ring.
RING_ENV = "MOECKPT_MEMORY_RING"
#: the run directory's record of its run id.
MARKER = "memory-tier.json"
#: the memory tier's default file format. Any backend that stores each writer's pieces in files of its own
#: (``stores_placements``, ``writer_of``) will do: a node's holdings are then a set of writers.
BACKEND = "safetensors"


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
        held = sum(_tree_bytes(os.path.join(self.node_dir, n)) for n in listdir_sorted(self.node_dir))
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
            backend=self.backend if slot is None or self.ring is None else RingWriter(self.ring, slot, self.backend),
            threads=write_threads(),
            coordinator=self.is_leader,
            hooks=SaveHooks(
                before_begin=lambda: self._begin(step),
                after_write=written,
                before_commit=lambda by_rank: replicate(self, location, by_rank, stats),
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

    def agree(self, error: str | None) -> None:
        """Raise :class:`MemorySaveError` on every rank when any rank reports an ``error`` (collective)."""
        errors = [e for e in collectives.all_gather_json(error, self.group) if e]
        if errors:
            raise MemorySaveError("; ".join(errors))

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
            for n in listdir_sorted(self.node_dir)
            if n.startswith(STEP_PREFIX)
            and n[len(STEP_PREFIX) :].isdigit()
            and os.path.exists(os.path.join(self.node_dir, n, INDEX_NAME))
        ]
        for step in sorted(steps)[: max(0, len(steps) - keep)]:
            shutil.rmtree(os.path.join(self.node_dir, step_dir_name(step)), ignore_errors=True)
        for name in listdir_sorted(self.node_dir):
            if name.startswith("."):  # a torn save's staging directory, an old checkpoint being replaced
                shutil.rmtree(os.path.join(self.node_dir, name), ignore_errors=True)

    def location(self, step: int) -> str:
        return os.path.join(self.node_dir, step_dir_name(step))

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


def listdir_sorted(path: str) -> list[str]:
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
