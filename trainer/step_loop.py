"""The :class:`Trainer`: one rank's training state, built (:mod:`.build`) and resumed (:mod:`.resume_run`) when it
is made, then trained by its step loop: one optimizer step, a save of the current step, and :meth:`Trainer.run`
(steps, saves every ``save_every`` steps and at the end, the NaN rollback, a stop request, the hang watchdog).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moeckpt.formats import dtypes
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.storage import is_url
from moeckpt.reshard.local import local_parts
from moeckpt.reshard.tensors import logical_tensors

from .balancing import balance_routers, balanced_routers
from .build import (
    build_checkpoints,
    build_loader,
    build_model,
    build_run_optimizer,
    build_schedule,
    join_layout,
    join_memory_tier,
)
from .config import TrainConfig
from .memory_pace import MemoryPace
from .metrics import MetricsLog
from .phases import phase_durations
from .preflight import DTYPES, check_run_dir, check_shape, open_dataset, run_model
from .progress_lines import ProgressLines
from .resume_run import ResumeSteps
from .watchdog import Watchdog

__all__ = ["Trainer"]

log = logging.getLogger(__name__)


class Trainer(ResumeSteps):
    """One rank's training state: model shard, optimizer, data, schedule, checkpoints and metrics.

    Made collectively by every rank: it is built in the run's layout (:meth:`_build`), then resumed from the
    newest checkpoint when the run has one (:meth:`_resume`); :meth:`run` trains it.
    """

    def __init__(
        self, config: TrainConfig, *, device: torch.device | None = None, marks: dict[str, float | None] | None = None
    ) -> None:
        self.config = config
        #: wall-clock marks of this start (:mod:`.phases`), logged as a ``restart_phases`` event after the first step.
        self.marks: dict[str, float | None] = dict(marks or {})
        #: :meth:`local_state`'s views, made at its first call, and the tensors it joins per call.
        self._local_views: dict[str, torch.Tensor] | None = None
        self._local_joins: dict[str, tuple[list[torch.Tensor], int]] = {}
        self._build(device or torch.device("cpu"))
        self.marks["model_built"] = time.time()
        self._resume()
        self.marks["loaded"] = time.time()

    def _build(self, device: torch.device) -> None:
        """Every part of this rank's state, in the order the collective steps need (:mod:`.build`); the run's
        checks come first, before anything is allocated."""
        config = self.config
        check_run_dir(config)
        self.spec = run_model(config)
        layout, self.groups = join_layout(config, self.spec, device)
        self.rank = self.groups.coords.rank
        self.device = device
        dtype = DTYPES[config.dtype]

        dataset = open_dataset(config, self.spec)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_shape(config, self.spec, layout, dataset, ranks_here=local_ranks, device_type=device.type)

        self.model = build_model(self.spec, self.groups, device, dtype)
        self._params = self.spec.param_specs()
        self.optimizer = build_run_optimizer(config, self.model, self._params, self.groups, held=self.spec.untrained())
        self._routers = balanced_routers(self.model)
        self.schedule = build_schedule(config)
        self.loader = build_loader(config, dataset, self.groups)
        self.tensors: dict[str, TensorEntry] = logical_tensors(
            self._params, param_dtype=dtypes.from_torch(dtype), optimizer_roles=self.optimizer.roles
        )
        self.checkpoints = build_checkpoints(config, self.tensors, layout, self.spec, rank=self.rank)
        self.metrics = MetricsLog(config.run_dir, enabled=self.rank == 0)
        self.memory = (
            join_memory_tier(config, self.rank, self.tensors, self.checkpoints.group) if config.memory_tier else None
        )
        self.checkpoints.memory = self.memory
        self.checkpoints.memory_pace = MemoryPace(every=config.memory_every if config.memory_tier else 0)
        if self.memory is not None and dist.is_initialized():
            self.checkpoints.decide_group = dist.new_group(backend="gloo")
        self.nan_rollbacks = 0
        self.step = 0
        self.resumed_from = None
        #: the tier the resume read from: ``memory`` or ``storage`` (the run directory); ``None`` for a fresh run.
        self.resume_tier = None

    # ------------------------------------------------------------------------------------------- steps

    def train_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.loader.consumed_samples,
            "data": self.loader.state_dict(),
            "schedule": self.schedule.state_dict(),
            "optimizer": {**self.optimizer.state_dict(), **self.optimizer.describe()},
            "seed": self.config.seed,
            "global_batch": self.config.global_batch,
            "seq_len": self.config.seq_len,
            "layout": self.groups.layout.to_json(),
        }

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's local tensor of every logical tensor (parameters as they are, ZeRO parts joined).

        The parameters and the optimizer's buffers are allocated once and only ever written in place, so the views
        of them are made once, at the first call; a tensor this rank holds in several parts is joined anew at every
        call (a copy). A save gathers this with training blocked: remaking a thousand views each time cost the
        snapshot about a tenth of its copy (docs/benchmarks/gpu.md)."""
        if self._local_views is None:
            self._local_views, self._local_joins = self._plan_local_state()
        out = dict(self._local_views)
        for name, (parts, dim) in self._local_joins.items():
            out[name] = torch.cat(parts, dim=dim)
        return out

    def _plan_local_state(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[list[torch.Tensor], int]]]:
        """The views :meth:`local_state` returns as they are, and the parts of each tensor it joins per call."""
        views: dict[str, torch.Tensor] = {name: p.detach() for name, p in self.model.named_parameters()}
        joins: dict[str, tuple[list[torch.Tensor], int]] = {}
        layout, rank = self.groups.layout, self.rank
        by_name: dict[str, dict] = {}
        for piece in self.optimizer.pieces():
            by_name.setdefault(piece.name, {})[piece.box] = piece.tensor
        for name, entry in self.tensors.items():
            if entry.role != "param":
                parts, dim = local_parts(entry, layout, rank, by_name.get(name, {}))
                if dim is None:
                    views[name] = parts[0]
                else:
                    joins[name] = (parts, dim)
        return views, joins

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of this rank's micro-batch (identical on the ranks of a TP group)."""
        return self.model.loss(inputs.to(self.device), targets.to(self.device))

    def mean_over_dp(self, value: torch.Tensor) -> float:
        """The mean of a per-rank scalar over the data-parallel group (the global batch's mean)."""
        value = value.detach().float().reshape(1).clone()
        if self.groups.layout.dp > 1:
            dist.all_reduce(value, group=self.groups.dp)
            value /= self.groups.layout.dp
        return float(value)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics record."""
        t0 = time.perf_counter()
        faults = self.checkpoints.faults
        if faults is not None:
            faults.before_step(self.step + 1)
        inputs, targets = self.loader.next()
        loss = self.loss(inputs, targets)
        if faults is not None:
            loss = faults.loss(self.step + 1, loss)
        loss.backward()
        lr = self.schedule.next()
        grad_norm = self.optimizer.step(lr)
        self.optimizer.zero_grad()
        # DeepSeek-V3's correction biases follow this step's expert load (nothing to do for other models)
        balance_routers(self._routers, self.config.bias_update_rate, self.groups.dp, group_size=self.groups.layout.dp)
        mean_loss = self.mean_over_dp(loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step += 1
        dt = time.perf_counter() - t0
        tokens = self.config.global_batch * self.config.seq_len
        return {
            "step": self.step,
            "loss": mean_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_s": dt,
            "tokens_per_s": tokens / dt,
            "save_blocked_s": 0.0,
            "world": self.groups.layout.world,
            "time": time.time(),
            "layout": self.groups.layout.to_json(),
        }

    def save(self, *, persist: bool = True, memory: bool | None = None) -> float:
        """Start a checkpoint of the current step, into the run directory (``persist``) and/or the memory tier
        (``memory``, default: with every persistent save when the tier is on); returns the seconds training was
        blocked (one snapshot for both)."""
        memory = self.memory is not None and (persist if memory is None else memory)
        # The states as callables: a memory save left out (the previous one in flight) gathers neither.
        stats = self.checkpoints.save(self.step, self.local_state, self.train_state, persist=persist, to_memory=memory)
        self.last_save = stats
        self.last_save_memory = memory and not stats.skipped
        return stats.blocked_s

    def run(self, *, should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Train up to ``stop_at`` (or ``steps``), saving every ``save_every`` steps and at the end.

        ``should_stop`` is asked before the first step and after every step; ``True`` saves and returns early (a
        SIGTERM handler's flag, say). It must answer the same on every rank at the same step (agree with an
        all-reduce first), since saving is collective.
        """
        cfg = self.config
        stop = cfg.steps if cfg.stop_at is None else cfg.stop_at
        last_saved = self.step if self.resumed_from else None
        records: list[dict[str, Any]] = []
        self.stopped_early = False
        watchdog = None
        if cfg.hang_timeout_s:
            watchdog = Watchdog(cfg.hang_timeout_s, report_path=self._hang_report_path()).start()
        meter = ProgressLines(self, stop)
        try:
            if self.step < stop and should_stop is not None and should_stop():
                self.stopped_early = True
                stop = self.step  # asked to stop before the first step: nothing new to save
            while self.step < stop:
                record = self.train_step()
                if watchdog is not None:
                    watchdog.beat(f"step {self.step}")
                if not math.isfinite(record["loss"]):
                    self.roll_back(record["loss"])
                    continue
                persist = bool(cfg.save_every and self.step % cfg.save_every == 0) or self.step == stop
                memory = self.memory is not None and (
                    self.checkpoints.memory_due(self.step) if cfg.memory_every else persist
                )
                if persist or memory:
                    record["save_blocked_s"] = self.save(persist=persist, memory=memory)
                    record["save"] = self._save_record()
                    if self.last_save.skipped:
                        record["memory_skipped"] = True
                    if persist:
                        last_saved = self.step
                if self.memory is not None and cfg.memory_every:
                    record["memory_every"] = self.checkpoints.memory_pace.effective
                self._report_memory_commits()
                self.metrics.write(record)
                if not records:
                    self._log_phases(record["time"])
                records.append(record)
                meter.step(record)
                if record["save_blocked_s"]:
                    self.metrics.flush()
                if should_stop is not None and self.step < stop and should_stop():
                    self.stopped_early = True
                    break
            # A save at the end, unless a stop notice came before the first step: then nothing was trained and
            # the run directory already holds the state (or, fresh, nothing worth a checkpoint of step 0).
            if last_saved != self.step and not (self.stopped_early and not records):
                self.save()
            self.checkpoints.wait()
            self._report_memory_commits()
            self._summarise_memory()
        finally:
            if watchdog is not None:
                watchdog.stop()
            self.metrics.flush()
        return records

    def _save_record(self) -> dict[str, Any]:
        """Where the training thread waited in the save just made (the step's ``save`` metrics): the state
        gathered, the in-flight question, the previous thread joined, the ring slot, the copy; ``blocked_s`` is
        all of it, ``bytes`` what the copy moved."""
        s = self.last_save
        return {
            "blocked_s": round(s.blocked_s, 6),
            "state_s": round(s.state_s, 6),
            "decide_s": round(s.decide_s, 6),
            "wait_s": round(s.wait_s, 6),
            "acquire_s": round(s.acquire_s, 6),
            "copy_s": round(s.copy_s, 6),
            "bytes": s.bytes_written,
            "memory": self.last_save_memory,
            "persisted": s.persisted,
            "skipped": s.skipped,
            "ring_pinned": s.ring_pinned,
            "ring_pinning": s.ring_pinning,
        }

    def _report_memory_commits(self) -> None:
        """A ``memory_commit`` event for each memory checkpoint committed since the last step: when its copy was
        taken and when it committed (the benchmarks' copy-to-commit latency, in seconds and in steps)."""
        for s in self.checkpoints.memory_commits():
            self.metrics.write(
                {
                    "event": "memory_commit",
                    "step": s.step,
                    "copied_at": s.copied_at,
                    "committed_at": s.memory_committed_at,
                    "after_copy_s": round((s.memory_committed_at or 0.0) - (s.copied_at or 0.0), 6),
                    "write_s": round(s.memory.seconds, 6) if s.memory is not None else None,
                    "at_step": self.step,
                    "time": time.time(),
                }
            )

    def _summarise_memory(self) -> None:
        """At the end of a run with ``--memory-every``: a ``memory_pace`` event with the interval asked for, the
        effective one, and the memory saves left out; logged on rank 0."""
        if self.memory is None or not self.config.memory_every:
            return
        pace = self.checkpoints.memory_pace.summary()
        self.metrics.write({"event": "memory_pace", "step": self.step, **pace, "time": time.time()})
        if self.rank == 0:
            log.info(
                "memory tier: --memory-every %d, effective interval %d steps at the end (widest %d), %d memory "
                "save(s) left out%s",
                pace["memory_every"],
                pace["effective_every"],
                pace["widest_every"],
                pace["left_out"],
                f" (steps {', '.join(map(str, pace['left_out_steps']))})" if pace["left_out"] else "",
            )

    def _log_phases(self, first_step: float) -> None:
        """After this start's first step (done at ``first_step``, before its save): when each phase of the start
        ended (``restart_phases`` event)."""
        self.marks["first_step"] = first_step
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        durations = phase_durations(self.marks)
        self.metrics.write(
            {
                "event": "restart_phases",
                "step": self.step,
                "restart": restart,
                "tier": self.resume_tier,
                "world": self.groups.layout.world,
                "marks": self.marks,
                "seconds": durations,
                "time": time.time(),
            }
        )
        if self.rank == 0 and self.resume_tier is not None:
            log.info("start to first step: %s", ", ".join(f"{k} {v:.2f} s" for k, v in durations.items()))

    def _hang_report_path(self) -> str:
        """Where the watchdog writes its stacks: the run directory, or a local file for a run on object storage."""
        name = f"hang-rank{self.rank}.txt"
        if not is_url(self.config.run_dir):
            return os.path.join(self.config.run_dir, name)
        return os.path.join(tempfile.gettempdir(), f"moeckpt-{os.getpid()}-{name}")

    def close(self) -> None:
        self.checkpoints.close()
