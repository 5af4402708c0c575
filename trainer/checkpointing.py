"""The trainer's checkpoint manager: distributed (a)synchronous saves through the format layer, retention, resume.

A save has two phases. The *snapshot* copies the bytes this rank writes (only the pieces it is the writer of:
replicated pieces are written by one replica) into reused host buffers, pinned when the tensors live on a GPU;
training is blocked only for that copy. The *persist* phase runs in a background thread, through the engine's one
save protocol (:mod:`moeckpt.reshard.save_protocol`, over a dedicated gloo group): the rank writes its file, the
ranks exchange what they wrote, and rank 0 commits the index only if every rank succeeded; a failure is the
protocol's :class:`~moeckpt.reshard.save_protocol.SaveFailedError` (``moeckpt.SaveFailedError``). At most one
persistent save is in flight; the next persistent save, ``wait()`` and ``close()`` wait for it.

With the memory tier (:mod:`.memory_tier`) a save that goes to both tiers writes the memory checkpoint from its
snapshot first, then the persistent one. A *memory-only* save never waits behind a persistent write (a large
state, a slow disk or bucket): it takes its own snapshot into a second set of host buffers (the same bytes as the
first: the host-memory cost of the tier's snapshots is at most twice this rank's written share, the second set
made only once a memory-only save is due) and commits it in its own thread, over the memory tier's own gloo group,
after the memory write before it. Only a memory-only save due while the previous memory-only one is still being
written (the memory tier cannot keep up with ``--memory-every``) is left out, on every rank alike: counted, logged,
and the interval widened (:mod:`.memory_pace`).

Every save records where the training thread waited (:class:`SaveStats`: the question whether a memory save is in
flight, the ring slot, the copy itself) and, once its memory checkpoint commits, when: the trainer writes both to
its metrics, for the benchmarks' blocked-against-bare-copy and copy-to-commit figures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import committed_steps, step_dir_name
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.formats.retention import RetentionPolicy, apply_gc, plan_gc
from moeckpt.formats.storage import join
from moeckpt.formats.storages import open_storage
from moeckpt.reshard import collectives
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.local import local_shape, local_views
from moeckpt.reshard.placement import placements
from moeckpt.reshard.save_protocol import SaveFailedError, SaveHooks, save_collective

from .faults import FaultInjector
from .memory_pace import MemoryPace
from .memory_tier import MemoryStats, MemoryTier

__all__ = ["CheckpointManager", "SaveFailedError", "SaveStats"]

log = logging.getLogger(__name__)


def _made(state):
    """A state given as a callable, made now (see :meth:`CheckpointManager.save`)."""
    return state() if callable(state) else state


@dataclass
class SaveStats:
    """Timings of one save, for metrics and benchmarks."""

    step: int
    blocked_s: float = 0.0
    persist_s: float = 0.0
    bytes_written: int = 0
    committed: bool = False
    error: str | None = None
    #: whether the save went to the persistent run directory (else only to the memory tier).
    persisted: bool = True
    #: the memory tier's save of the same snapshot, if any (written before the persistent one).
    memory: MemoryStats | None = None
    #: a memory-only save left out because the previous memory-only save was still being written on some rank.
    skipped: bool = False
    #: the memory ring's slot the snapshot landed in (:mod:`.memory_ring`), busy until this save's writes end.
    memory_slot: int | None = None
    #: seconds of ``blocked_s`` spent gathering the local state and train state (when given as callables).
    state_s: float = 0.0
    #: seconds spent asking every rank whether a memory save is still in flight (a collective); part of
    #: ``blocked_s``, except for a left-out save, whose ``blocked_s`` is 0 (it gathered and copied nothing).
    decide_s: float = 0.0
    #: seconds of ``blocked_s`` spent waiting for the previous memory-only save's thread to be joined.
    wait_s: float = 0.0
    #: seconds of ``blocked_s`` spent taking a ring slot (and unlinking the step it held).
    acquire_s: float = 0.0
    #: seconds of ``blocked_s`` that were the snapshot's own copy (device-to-host, or host-to-host on a CPU).
    copy_s: float = 0.0
    #: with a memory ring: whether the snapshot's slot was registered as pinned memory at the copy, and whether
    #: the ring's registration was still running then.
    ring_pinned: bool | None = None
    ring_pinning: bool | None = None
    #: wall-clock time (``time.time()``) the snapshot was taken, and the memory checkpoint committed.
    copied_at: float | None = None
    memory_committed_at: float | None = None


@dataclass
class _InFlight:
    thread: threading.Thread
    stats: SaveStats
    error: list[BaseException] = field(default_factory=list)


class CheckpointManager:
    """Saves a rank's share of the training state into ``run_dir/step-XXXXXXXX`` checkpoints."""

    def __init__(
        self,
        run_dir: str,
        *,
        tensors: dict[str, TensorEntry],
        layout: Layout,
        model: dict[str, Any],
        backend: str = "safetensors",
        compress: str = NONE,
        retention: RetentionPolicy | None = None,
        async_save: bool = True,
        faults: FaultInjector | None = None,
    ):
        self.run_dir = run_dir
        self.tensors = tensors
        self.layout = layout
        self.model = model
        self.backend_name = backend
        #: the compression setting of every checkpoint it saves (the memory tier's copies are raw).
        self.compress = compress
        self.backend = get_backend(backend, compress=compress)
        self.retention = retention or RetentionPolicy()
        self.async_save = async_save
        #: injected faults (tests, demo): a kill after this rank's file is written, a corrupted file after commit.
        self.faults = faults
        self.rank = collectives.rank()
        if collectives.world_size() != layout.world:
            raise MoeckptError(
                f"layout {layout} needs {layout.world} ranks, the process group has {collectives.world_size()}"
            )
        # A separate gloo group: the background thread's coordination never interleaves with training collectives
        # (which may be NCCL/RCCL on GPUs).
        self.group = dist.new_group(backend="gloo") if collectives.is_distributed() else None
        # Which views of each local tensor this rank writes, computed once: a save then only slices and copies.
        self._plan: dict[str, tuple[tuple[int, ...], list[tuple[Box, int, int, int]]]] = {}
        for name, e in tensors.items():
            wanted = {p.box for p in placements(e, layout) if p.writer == self.rank}
            views = [v for v in local_views(e, layout, self.rank) if v[0] in wanted]
            self._plan[name] = (local_shape(e, layout, self.rank), views)
        self._buffers: dict[tuple[str, Box], torch.Tensor] = {}
        #: the memory-only saves' snapshot buffers: a persistent write in flight keeps ``_buffers`` busy.
        self._memory_buffers: dict[tuple[str, Box], torch.Tensor] = {}
        self._inflight: _InFlight | None = None
        #: the memory-only save in flight (its own thread and buffers).
        self._memory_inflight: _InFlight | None = None
        #: set when the memory write scheduled last has ended: memory writes commit in step order, one at a time.
        self._memory_done: threading.Event | None = None
        self.history: list[SaveStats] = []
        #: the in-memory tier (:mod:`.memory_tier`), set by the trainer with ``--memory-tier``.
        self._memory: MemoryTier | None = None
        #: the memory interval and the memory saves left out (:mod:`.memory_pace`); the trainer sets
        #: ``--memory-every``'s.
        self.memory_pace = MemoryPace(every=0)
        #: memory commits not yet reported by :meth:`memory_commits`.
        self._unreported: list[SaveStats] = []
        #: a gloo group of the whole world for the training thread's one question before a memory-only save
        #: (is the previous memory-only save still being written anywhere?), set with :attr:`memory`. The memory
        #: tier's own group must not be :attr:`group` either: its writes run beside a persistent one.
        self.decide_group = None

    @property
    def memory(self) -> MemoryTier | None:
        """The in-memory tier (:mod:`.memory_tier`), set by the trainer with ``--memory-tier``. Setting it opens
        this rank's memory ring (:mod:`.memory_ring`) at once, while the model loads: the snapshots of the saves
        that go to memory land in its slots, which are the memory checkpoint's files."""
        return self._memory

    @memory.setter
    def memory(self, tier: MemoryTier | None) -> None:
        self._memory = tier
        if tier is not None:
            layout = [(name, box) for name, (_, views) in self._plan.items() for box, *_ in views]
            pin = torch.cuda.is_available() and torch.cuda.is_initialized()
            tier.open_ring(self.rank, layout, self.tensors, pin=pin)

    def _ring_views(self, slot: int) -> dict[tuple[str, Box], torch.Tensor]:
        ring = self._memory.ring if self._memory is not None else None
        if ring is None:
            raise MoeckptError("a memory ring slot without a memory ring")  # never: a slot comes from the ring
        return ring.views(slot)

    def _ring_slot(self, step: int) -> int | None:
        ring = self._memory.ring if self._memory is not None else None
        return ring.acquire(step) if ring is not None else None

    def _ring_state(self, stats: SaveStats) -> None:
        """Note in ``stats`` whether the snapshot's slot was pinned and the ring still being pinned."""
        ring = self._memory.ring if self._memory is not None else None
        if ring is not None and stats.memory_slot is not None:
            stats.ring_pinned, stats.ring_pinning = ring.slot_pinned(stats.memory_slot), ring.pinning

    # -- saving ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        local_state: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]],
        train_state: dict[str, Any] | Callable[[], dict[str, Any]],
        *,
        persist: bool = True,
        to_memory: bool = False,
    ) -> SaveStats:
        """Snapshot ``local_state`` (logical tensor name -> this rank's local tensor) and persist it.

        With ``to_memory`` (and a memory tier) the same snapshot is first committed into the memory tier, then,
        with ``persist``, into the run directory: one host copy, two writers. Returns after the snapshot when
        saving asynchronously, after the commit(s) otherwise. Either state may be a callable that makes it: it
        is then made only once the save is known to take a snapshot (a memory save left out gathers nothing).
        """
        entered = time.perf_counter()
        to_memory = to_memory and self.memory is not None
        if to_memory and not persist:
            return self._save_memory_only(step, local_state, train_state, entered)
        self._wait_persistent()
        waited = time.perf_counter()
        decide_s, left = 0.0, False
        if to_memory:
            busy = self._busy_anywhere()
            decide_s = time.perf_counter() - waited
            if busy:
                # The memory tier never delays a persistent save: while a memory-only write is still in flight (on
                # any rank: all decide alike), this save goes to the run directory alone instead of queueing behind
                # it, so a memory tier slower than --memory-every cannot leave the newest persisted step older than
                # it would be without one. Its memory part is left out, counted and logged as any other.
                self.memory_pace.left_out(step, self._memory_step_in_flight())
                to_memory, left = False, True
            else:
                self.memory_pace.kept_up(step)
        t0 = time.perf_counter()
        local, state = _made(local_state), _made(train_state)
        t1 = time.perf_counter()
        slot = self._ring_slot(step) if to_memory else None
        t2 = time.perf_counter()
        # With a memory ring the snapshot lands in its slot, and the persistent write reads the same slot.
        pieces = self._snapshot(local, self._buffers if slot is None else self._ring_views(slot))
        stats = SaveStats(
            step=step,
            blocked_s=0.0,
            bytes_written=sum(p.data.numel() * p.data.element_size() for p in pieces),
            persisted=persist,
            memory_slot=slot,
            state_s=t1 - t0,
            decide_s=decide_s,
            wait_s=waited - entered,
            acquire_s=t2 - t1,
            copy_s=time.perf_counter() - t2,
            copied_at=time.time(),
            skipped=left,
        )
        self._ring_state(stats)
        memory_turn = self._memory_turn() if to_memory else None
        self._inflight = self._start(step, pieces, state, stats, to_memory, memory_turn, entered, "save")
        return stats

    def _save_memory_only(self, step: int, local_state, train_state, entered: float) -> SaveStats:
        """A memory checkpoint from a fresh snapshot into the memory-only buffers, written in its own thread: a
        persistent write in flight is not waited for (its memory part, if any, is: memory commits stay in order)."""
        busy = self._busy_anywhere()
        decided = time.perf_counter()
        if busy:
            # A memory checkpoint is worth having only if it costs no training time: while the previous memory-only
            # save is still being written (the tier is slower than --memory-every), this one is left out on every
            # rank, and the interval widens (every rank alike: the answer above is agreed).
            stats = SaveStats(step=step, persisted=False, skipped=True, decide_s=decided - entered)
            self.history.append(stats)
            self.memory_pace.left_out(step, self._memory_step_in_flight())
            return stats
        self.memory_pace.kept_up(step)
        self._wait_memory()
        t0 = time.perf_counter()
        local, state = _made(local_state), _made(train_state)
        t1 = time.perf_counter()
        slot = self._ring_slot(step)
        t2 = time.perf_counter()
        if slot is None and not self._memory_buffers and self.rank == 0:
            share = sum(e.nbytes for e in self.tensors.values()) / max(1, self.layout.world)
            log.info(
                "memory-only saves take their own snapshot (host buffers of about %.1f MB per rank, beside the "
                "persistent save's), so they need not wait for a persistent save being written",
                share / 1e6,
            )
        pieces = self._snapshot(local, self._memory_buffers if slot is None else self._ring_views(slot))
        stats = SaveStats(
            step=step,
            bytes_written=sum(p.data.numel() * p.data.element_size() for p in pieces),
            persisted=False,
            memory_slot=slot,
            state_s=t1 - t0,
            decide_s=decided - entered,
            wait_s=t0 - decided,
            acquire_s=t2 - t1,
            copy_s=time.perf_counter() - t2,
            copied_at=time.time(),
        )
        self._ring_state(stats)
        memory_turn = self._memory_turn()
        self._memory_inflight = self._start(step, pieces, state, stats, True, memory_turn, entered, "memory-save")
        return stats

    @property
    def memory_skipped(self) -> int:
        """Memory saves left out so far (:attr:`memory_pace`)."""
        return self.memory_pace.left

    def memory_due(self, step: int) -> bool:
        """Whether a memory-only save is due at ``step`` (the effective interval, :mod:`.memory_pace`)."""
        return self.memory is not None and self.memory_pace.due(step)

    def _memory_step_in_flight(self) -> int | None:
        inflight = self._memory_inflight
        return inflight.stats.step if inflight is not None and inflight.thread.is_alive() else None

    def memory_commits(self) -> list[SaveStats]:
        """The saves whose memory checkpoint committed since the last call (training thread), oldest first."""
        done = [s for s in self._unreported if s.memory is not None]
        self._unreported = [s for s in self._unreported if s.memory is None]
        return [s for s in done if s.memory_committed_at is not None]

    def _start(
        self, step, pieces, train_state, stats: SaveStats, to_memory: bool, memory_turn, t0: float, what: str
    ) -> _InFlight | None:
        """Write the snapshot ``pieces``: in a thread of its own when saving asynchronously (returned, to be
        joined), else here; ``stats.blocked_s`` is the time since ``t0`` (the save was asked for) that training
        waited, the thread's start included."""
        inflight = None
        if self.async_save:
            errors: list[BaseException] = []
            thread = threading.Thread(
                target=self._persist_guarded,
                args=(step, pieces, dict(train_state), stats, errors, to_memory, memory_turn),
                daemon=True,
                name=f"moeckpt-{what}-{step}",
            )
            inflight = _InFlight(thread, stats, errors)
            if to_memory:
                self._unreported.append(stats)
            thread.start()
            stats.blocked_s = time.perf_counter() - t0
        else:
            if to_memory:
                self._unreported.append(stats)
            self._write(step, pieces, dict(train_state), stats, to_memory, memory_turn)
            stats.blocked_s = time.perf_counter() - t0
        self.history.append(stats)
        return inflight

    def _memory_turn(self) -> tuple[threading.Event | None, threading.Event]:
        """The memory write scheduled before this one (to wait for) and this one's end (for the next)."""
        previous, self._memory_done = self._memory_done, threading.Event()
        return previous, self._memory_done

    def wait(self) -> SaveStats | None:
        """Wait for the saves in flight (the persistent one and a memory-only one); raise
        :class:`SaveFailedError` if one failed. Returns the persistent save's stats, if one was in flight."""
        try:
            stats = self._wait_persistent()
        finally:
            self._wait_memory()
        return stats

    def _wait_persistent(self) -> SaveStats | None:
        inflight, self._inflight = self._inflight, None
        return self._join(inflight)

    def _wait_memory(self) -> SaveStats | None:
        inflight, self._memory_inflight = self._memory_inflight, None
        return self._join(inflight)

    def _join(self, inflight: _InFlight | None) -> SaveStats | None:
        if inflight is None:
            return None
        inflight.thread.join()
        if inflight.error:
            raise SaveFailedError(f"save of step {inflight.stats.step} to {self.run_dir} failed: {inflight.error[0]}")
        return inflight.stats

    def close(self) -> None:
        self.wait()

    def _busy_anywhere(self) -> bool:
        """Whether a memory-only save is still being written on any rank (collective over :attr:`decide_group`)."""
        busy = self._memory_inflight is not None and self._memory_inflight.thread.is_alive()
        if self.decide_group is None:
            return busy
        flag = torch.tensor([int(busy)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.decide_group)
        return bool(flag.item())

    def _snapshot(
        self, local_state: dict[str, torch.Tensor], buffers: dict[tuple[str, Box], torch.Tensor]
    ) -> list[Piece]:
        missing = set(self.tensors) - set(local_state)
        if missing:
            raise MoeckptError(f"save: the state lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        pieces = []
        copies = []
        for name, (shape, views) in self._plan.items():
            local = local_state[name].detach()
            if tuple(local.shape) != shape:
                raise MoeckptError(
                    f"save: {name}: rank {self.rank} holds a local tensor of shape {tuple(local.shape)}, "
                    f"layout {self.layout} expects {shape}"
                )
            for box, dim, start, length in views:
                view = local.narrow(dim, start, length) if box.ndim else local
                buf = buffers.get((name, box))
                if buf is None:
                    pin = view.device.type != "cpu" and torch.cuda.is_available()
                    buf = torch.empty(box.shape, dtype=view.dtype, pin_memory=pin)
                    buffers[(name, box)] = buf
                buf.copy_(view, non_blocking=True)
                copies.append(view.device)
                pieces.append(Piece(name, box, buf))
        if any(d.type == "cuda" for d in copies):
            torch.cuda.synchronize()
        return pieces

    def _persist_guarded(
        self,
        step,
        pieces,
        train_state,
        stats: SaveStats,
        errors: list[BaseException],
        to_memory: bool = False,
        memory_turn=None,
    ) -> None:
        try:
            self._write(step, pieces, train_state, stats, to_memory, memory_turn)
        except BaseException as e:  # noqa: BLE001 - reported to the training thread by wait()
            errors.append(e)
            stats.error = str(e)

    def _write(
        self,
        step: int,
        pieces: list[Piece],
        train_state: dict[str, Any],
        stats: SaveStats,
        to_memory: bool,
        memory_turn: tuple[threading.Event | None, threading.Event] | None = None,
    ) -> None:
        """The memory tier first (seconds of host memory, the likelier one to be resumed from), then the run
        directory. A failed memory save is logged and costs only that memory checkpoint, never the run. The
        memory ring's slot, if the snapshot is in one, is released once both are written."""
        try:
            if to_memory and self.memory is not None:
                previous, done = memory_turn or (None, None)
                try:
                    if previous is not None:
                        previous.wait()  # the memory write before this one (a thread of its own) has ended
                    saved = self.memory.save(
                        step,
                        pieces,
                        tensors=self.tensors,
                        layout_json=self.layout.to_json(),
                        model=self.model,
                        train_state=train_state,
                        slot=stats.memory_slot,
                    )
                    stats.memory_committed_at = time.time()  # before .memory: memory_commits() reads them in turn
                    stats.memory = saved
                except MoeckptError as e:  # every rank raises it alike (agreed inside), none is left in a collective
                    stats.memory = MemoryStats(step=step, error=str(e))
                    log.warning("memory checkpoint of step %d not committed: %s", step, e)
                finally:
                    if done is not None:
                        done.set()
            elif memory_turn is not None:
                memory_turn[1].set()
            if stats.persisted:
                self._persist(step, pieces, train_state, stats)
            else:
                stats.committed = stats.memory is not None and stats.memory.committed
        finally:
            if stats.memory_slot is not None and self.memory is not None and self.memory.ring is not None:
                self.memory.ring.release(stats.memory_slot)

    def _persist(self, step: int, pieces: list[Piece], train_state: dict[str, Any], stats: SaveStats) -> None:
        """The persistent save of one snapshot, through the engine's save protocol
        (:func:`~moeckpt.reshard.save_protocol.save_collective`): rank 0 commits, then applies the retention."""
        t0 = time.perf_counter()
        location = join(self.run_dir, step_dir_name(step))
        index = Index(
            backend=self.backend_name,
            compress=self.compress,
            step=step,
            layout=self.layout.to_json(),
            model=self.model,
            tensors=self.tensors,
            files={},
            train_state=train_state,
        )

        def after_write(written) -> None:
            if self.faults is not None:
                self.faults.during_save(step)  # dies here: its file is written, nothing is committed

        def after_commit(final: Index) -> None:
            if self.rank == 0:
                log.info(
                    "saved step %d to %s: %.2f MB in %.2f s",
                    step,
                    location,
                    final.nbytes / 1e6,  # the state's bytes: a zarr index lists only the metadata documents
                    time.perf_counter() - t0,
                )
                apply_gc(self.run_dir, replace(plan_gc(self.run_dir, self.retention), remove_uncommitted=[]))
            stats.committed = True
            if self.faults is not None and open_storage(location).is_local:
                self.faults.after_commit(step, open_storage(location).location)

        boxes = {name: [p.box for p in placements(e, self.layout)] for name, e in self.tensors.items()}
        save_collective(
            location,
            index,
            pieces,
            boxes,
            group=self.group,
            replace_uncommitted=True,
            backend=self.backend,
            threads=1,
            hooks=SaveHooks(after_write=after_write, after_commit=after_commit),
            commit_log_level=logging.DEBUG,
        )
        stats.persist_s = time.perf_counter() - t0

    # -- resuming -------------------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        steps = committed_steps(self.run_dir)
        return steps[-1][0] if steps else None
