"""The training loop: a model shard per rank, ZeRO-1 AdamW, checkpoints through moeckpt, automatic resume.

One process per rank (torchrun, or :func:`moeckpt.trainer.local_world.run_local_world` in tests); each calls
:func:`train` with the same :class:`TrainConfig`. The layout is ``(tp, ep, dp = world / tp)``. A run directory holds
``step-XXXXXXXX`` checkpoints and ``metrics.jsonl``; starting :func:`train` on a run directory that already has a
committed checkpoint continues from the newest one, in whatever layout this invocation has (load-time resharding).

Everything that decides the numbers is a function of the config and the step, never of the layout: the initial
weights (``(seed, tensor name)``, as ``moeckpt init``), the samples of each step (a global sample counter), the
learning rate (a pure function of the step). So the same run in another layout gives the same losses up to
floating-point reduction order, and a resume in the same layout continues bit for bit.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader, committed_steps, quarantine
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import INDEX_NAME, TensorEntry
from moeckpt.formats.retention import RetentionPolicy
from moeckpt.formats.storage import is_url
from moeckpt.formats.storages import open_storage
from moeckpt.reshard import collectives
from moeckpt.reshard.local import join_local
from moeckpt.reshard.state_dict_checkpoints import is_state_dict
from moeckpt.reshard.tensors import logical_tensors

from .adamw import AdamWConfig
from .checkpointing import CheckpointManager
from .config import DTYPES as CONFIG_DTYPES
from .config import RESUME_READS, TrainConfig
from .data import BatchLoader, DataError, TokenDataset, default_text_path
from .distributed import build_parallel_model
from .faults import FaultInjector, parse_fault
from .init_values import initial_value
from .logs import progress
from .memory import check_fits, training_bytes
from .memory_tier import MemoryTier, check_host_budget, restore_newest, run_id, run_root
from .metrics import MetricsLog
from .models import ModelSpec, resolve_model
from .muon import MuonConfig
from .optimizer_choice import build_optimizer, check_run_optimizer
from .parallel import ParallelGroups, build_groups, choose_layout, init_from_env
from .phases import phase_durations, process_start_time
from .preemption import PreemptionFlag
from .resume import DAMAGED_CHECKPOINT_ERRORS, Restored, ResumeError, restore, restore_from_state_dict
from .schedule import LRSchedule, ScheduleConfig
from .watchdog import Watchdog

__all__ = [
    "DTYPES",
    "RESUME_READS",
    "NonFiniteLossError",
    "RunSummary",
    "TrainConfig",
    "Trainer",
    "check_launch",
    "run_training",
    "train",
]

#: ``--dtype`` values and the parameter dtype they select.
DTYPES = {short: dtypes.to_torch(name) for short, name in dtypes.short_names(*CONFIG_DTYPES).items()}

log = logging.getLogger(__name__)


class NonFiniteLossError(MoeckptError, FloatingPointError):
    """The loss became NaN or infinite; the run stops without saving the broken state."""

    exit_code = 1


@dataclass(frozen=True)
class RunSummary:
    """What one invocation of :func:`run_training` did on this rank."""

    #: the metrics records of the steps this invocation trained (this rank's view).
    records: list[dict[str, Any]]
    #: the run's step when the invocation ended.
    step: int
    #: whether a SIGTERM stopped it (its step saved).
    preempted: bool = False


def run_model(config: TrainConfig) -> ModelSpec:
    """The run's model: ``config.model``, or the model of the ``init_from`` checkpoint when that is empty."""
    if config.model:
        return resolve_model(config.model)
    if not config.init_from:
        raise ResumeError("no model to train: pass --model PRESET|JSON, or --init-from a checkpoint to take it from")
    index = CheckpointReader(config.init_from).index
    if is_state_dict(index):
        raise ResumeError(
            f"--init-from {config.init_from}: a state-dict checkpoint records no model; pass --model "
            "naming the bundled model its tensors are (Hugging Face names)"
        )
    return ModelSpec.from_json(index.model)


def check_run_dir(config: TrainConfig) -> None:
    """Refuse a run directory that is itself a checkpoint: the run would ignore it and save steps inside it."""
    if open_storage(config.run_dir).exists(INDEX_NAME):
        raise ResumeError(
            f"{config.run_dir}: is a checkpoint, not a run directory; to train from it pass --init-from "
            f"{config.run_dir} with a new --run-dir"
        )


def check_launch(
    config: TrainConfig, nproc: int, *, worlds: Sequence[int] | None = None, device_type: str | None = None
) -> None:
    """Refuse, before any process starts, a model, layout, data file or memory budget that cannot work with
    ``nproc`` processes on this host in a world of ``nproc`` (or of each size in ``worlds``, for an elastic job):
    each worker would otherwise fail alone, behind torchrun's generic exit code."""
    check_run_dir(config)
    check_run_optimizer(config.run_dir, config.init_from, config.optimizer, config.reset_optimizer)
    spec = run_model(config)
    dataset = open_dataset(config, spec)
    params = sum(math.prod(p.shape) for p in spec.param_specs())
    for world in worlds or (nproc,):
        layout = choose_layout(world, tp=config.tp, ep=config.ep, check=spec.check_layout)
        check_shape(
            config,
            spec,
            layout,
            dataset,
            ranks_here=nproc,
            params=params,
            device_type=device_type or _device_type(config),
        )
        if config.memory_tier:
            # weights, an fp32 master for lower-precision weights, and at most two fp32 moments per parameter
            per_param = DTYPES[config.dtype].itemsize + (4 if config.dtype != "fp32" else 0) + 8
            check_host_budget(
                config.run_dir,
                config.memory_dir,
                keep=config.memory_keep,
                replicas=config.memory_replicas,
                state_bytes=params * per_param,
                ranks_here=nproc,
                world=world,
            )


def _device_type(config: TrainConfig) -> str:
    return "cpu" if config.cpu or not torch.cuda.is_available() else "cuda"


def open_dataset(config: TrainConfig, spec: ModelSpec) -> TokenDataset:
    return TokenDataset(
        config.data or default_text_path(),
        seq_len=config.seq_len,
        dtype=config.data_dtype,
        vocab_size=getattr(spec.config, "vocab_size", None),
    )


def check_shape(
    config: TrainConfig,
    spec: ModelSpec,
    layout,
    dataset: TokenDataset,
    *,
    ranks_here: int,
    device_type: str,
    params: int | None = None,
) -> None:
    """Refuse a batch the data or the layout cannot give, or a run the memory cannot hold, before allocating."""
    if config.global_batch % layout.dp:
        raise DataError(
            f"--global-batch: global_batch={config.global_batch} is not divisible by dp = nproc / tp = {layout.dp}: "
            "every data-parallel rank must read the same number of samples"
        )
    if config.global_batch > len(dataset):
        raise DataError(
            f"--global-batch {config.global_batch} is more than the {len(dataset)} samples of --seq-len "
            f"{config.seq_len} in {dataset.path}: one step would read samples twice; use a smaller batch or more data"
        )
    max_pos = getattr(spec.config, "max_position_embeddings", None)
    if max_pos is not None and config.seq_len > max_pos:
        raise DataError(f"--seq-len {config.seq_len} is longer than the model's max_position_embeddings={max_pos}")
    need = training_bytes(
        spec,
        tp=layout.tp,
        ep=layout.ep,
        dp=layout.dp,
        micro_batch=config.global_batch // layout.dp,
        seq_len=config.seq_len,
        param_bytes=DTYPES[config.dtype].itemsize,
        params=params,
    )
    check_fits(
        need,
        ranks_here=ranks_here,
        device_type=device_type,
        what=f"training {spec.arch} in layout {layout}",
        fix="use a smaller model, --global-batch or --seq-len, more ranks (--nproc, --tp, --ep), or --dtype bf16",
    )


def setup_world(config: TrainConfig) -> torch.device:
    """Join the torchrun world when the environment has one (or reuse an initialized one); the device to use."""
    if dist.is_initialized() or "RANK" in os.environ:
        device = init_from_env(backend=config.backend)
    else:
        from .parallel import default_device

        device = default_device()
    return torch.device("cpu") if config.cpu else device


class Trainer:
    """One rank's training state: model shard, optimizer, data, schedule, checkpoints and metrics."""

    def __init__(
        self, config: TrainConfig, *, device: torch.device | None = None, marks: dict[str, float | None] | None = None
    ) -> None:
        self.config = config
        #: wall-clock marks of this start (:mod:`.phases`), logged as a ``restart_phases`` event after the first step.
        self.marks: dict[str, float | None] = dict(marks or {})
        check_run_dir(config)
        self.spec: ModelSpec = run_model(config)
        world = dist.get_world_size() if dist.is_initialized() else 1
        layout = choose_layout(world, tp=config.tp, ep=config.ep, check=self.spec.check_layout)
        device = device or torch.device("cpu")
        self.groups: ParallelGroups = build_groups(layout, device=device)
        self.rank = self.groups.coords.rank
        self.device = device
        dtype = DTYPES[config.dtype]

        dataset = open_dataset(config, self.spec)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_shape(config, self.spec, layout, dataset, ranks_here=local_ranks, device_type=device.type)

        # Made where it trains: the plan's initial fill runs on the device, and nothing is copied there after.
        with torch.device(device):
            model = build_parallel_model(self.spec, self.groups)
        self.model = model.to(device=device, dtype=dtype)
        self.model.train()
        params = self.spec.param_specs()
        self.optimizer = build_optimizer(
            config.optimizer,
            self.model.named_parameters(),
            params,
            self.groups,
            AdamWConfig(weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm or None),
            muon=MuonConfig(momentum=config.muon_momentum, ns_steps=config.muon_ns_steps, scheme=config.muon_scheme),
        )
        self._params = params
        warmup = min(config.warmup_steps, config.steps)
        self.schedule = LRSchedule(
            ScheduleConfig(
                lr=config.lr, warmup_steps=warmup, decay_steps=config.steps, min_lr_ratio=config.min_lr_ratio
            )
        )
        self.loader = BatchLoader(
            dataset,
            global_batch=config.global_batch,
            dp_rank=self.groups.coords.dp_rank,
            dp=layout.dp,
            seed=config.seed,
        )
        param_dtype = dtypes.from_torch(dtype)
        self.tensors: dict[str, TensorEntry] = logical_tensors(
            params, param_dtype=param_dtype, optimizer_roles=self.optimizer.roles
        )
        self.checkpoints = CheckpointManager(
            config.run_dir,
            tensors=self.tensors,
            layout=layout,
            model=self.spec.to_json(),
            backend=config.format,
            retention=RetentionPolicy(keep_last=config.keep_last),
            async_save=config.async_save,
            faults=self._faults(config),
        )
        self.metrics = MetricsLog(config.run_dir, enabled=self.rank == 0)
        self.memory: MemoryTier | None = self._memory_tier(config) if config.memory_tier else None
        self.checkpoints.memory = self.memory
        if self.memory is not None and dist.is_initialized():
            self.checkpoints.decide_group = dist.new_group(backend="gloo")
        self.nan_rollbacks = 0
        self.step = 0
        self.resumed_from: str | None = None
        #: the tier the resume read from: ``memory`` or ``storage`` (the run directory); ``None`` for a fresh run.
        self.resume_tier: str | None = None
        self.marks["model_built"] = time.time()
        self._resume()
        self.marks["loaded"] = time.time()

    # ------------------------------------------------------------------------------------------- set-up

    @torch.no_grad()
    def _init_weights(self, params) -> None:
        """Overwrite the randomly initialised tensors with values that depend on (seed, name) only, so every
        layout starts from the same model; ones/zeros (and model-specific constants) are layout-free already."""
        specs = {p.name: p for p in params}
        std = getattr(self.spec.config, "initializer_range", 0.02)
        current: tuple[str, torch.Tensor] | None = None  # one full tensor at a time: pieces come grouped by param
        for piece in self.optimizer.param_pieces():
            spec = specs[piece.param]
            if spec.init != "normal":
                continue
            if current is None or current[0] != piece.param:
                entry = TensorEntry(
                    name=spec.name, shape=tuple(spec.shape), dtype="float32", role="param", param=spec.name
                )
                current = (piece.param, initial_value(entry, seed=self.config.seed, std=std))
            piece.tensor.copy_(current[1][piece.box.slices()])
        self.optimizer.load_master_from_params()

    def _memory_tier(self, config: TrainConfig) -> MemoryTier:
        """Join the memory tier (collective): the run's id from its run directory, the budget checked."""
        rid = collectives.broadcast_json(
            run_id(config.run_dir, create=True) if self.rank == 0 else None, 0, self.checkpoints.group
        )
        # Its own gloo group: a memory-only save is written beside a persistent one still in flight (which talks
        # over the checkpoint manager's group), never behind it.
        group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        tier = MemoryTier(
            run_root(config.memory_dir, rid),
            group=group,
            keep=config.memory_keep,
            replicas=config.memory_replicas,
            state_bytes=sum(e.nbytes for e in self.tensors.values()),
        )
        tier.check_budget()
        return tier

    def _resume(self) -> None:
        restored = self._restore_newest_intact()
        if restored is None:
            # Only a fresh start needs the layout-free initial values: a resume overwrites every tensor they set,
            # and making them (one full tensor of every parameter, on the CPU) took seconds of each restart.
            self._init_weights(self._params)
            if self.config.init_from:
                self._start_from(self.config.init_from)
            return
        state = restored.train_state
        self.step = int(state.get("step", restored.step))
        if "data" in state:
            self.loader.load_state_dict(state["data"])
        else:
            self.loader.consumed_samples = self.step * self.config.global_batch
        self.schedule.steps = int(state.get("schedule", {}).get("steps", self.step))
        self.resumed_from = restored.location
        self.resume_stats = restored.stats
        everyone = collectives.all_gather_json(
            [restored.stats.bytes_read, restored.stats.bytes_needed, restored.stats.seconds], self.checkpoints.group
        )
        read = sum(r[0] for r in everyone)
        self.metrics.write(
            {
                "event": "resume",
                "step": self.step,
                "tier": self.resume_tier,
                "memory_bytes_read": read if self.resume_tier == "memory" else 0,
                "storage_bytes_read": read if self.resume_tier == "storage" else 0,
                "from_layout": restored.source_layout.to_json(),
                "to_layout": self.groups.layout.to_json(),
                # storage reads of all ranks against the bytes the new layout holds (replicas counted once per rank)
                "bytes_read": sum(r[0] for r in everyone),
                "bytes_needed": sum(r[1] for r in everyone),
                "state_bytes": sum(e.nbytes for e in self.tensors.values()),
                "exchanged": restored.exchanged,
                "time": time.time(),
                "seconds": max(r[2] for r in everyone),
                "optimizer_reset": restored.optimizer_reset,
            }
        )
        if self.rank == 0:
            st = restored.stats
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
            why = f" after restart {restart} of the workers" if restart else ""
            fresh = (
                f"; its optimizer state is not {self.optimizer.name}'s: started fresh"
                if restored.optimizer_reset
                else ""
            )
            log.info(
                "resumed from %s %s (step %d, written in layout %s) into layout %s%s: rank 0 read %.2f MB for %.2f "
                "MB of state in %.2f s%s",
                "host memory" if self.resume_tier == "memory" else "storage",
                restored.location,
                self.step,
                restored.source_layout,
                self.groups.layout,
                why,
                st.bytes_read / 1e6,
                st.bytes_needed / 1e6,
                st.seconds,
                fresh,
            )
            if restored.source_layout != self.groups.layout:
                log.info("layout change: %s -> %s (resharded at load)", restored.source_layout, self.groups.layout)

    def _start_from(self, location: str) -> None:
        """Load ``init_from``'s parameters and optimizer state (resharded, collective); the run starts at step 0."""
        if is_state_dict(CheckpointReader(location).index):  # another trainer's state dict under our model's names
            restored = restore_from_state_dict(location, self.optimizer, self.spec, group=self.checkpoints.group)
        else:
            restored = restore(
                location,
                self.optimizer,
                model_json=self.spec.to_json(),
                group=self.checkpoints.group,
                reads=self.config.resume_reads,
                reset_optimizer=self.config.reset_optimizer,
            )
        self.metrics.write(
            {
                "event": "init_from",
                "location": restored.location,
                "checkpoint_step": restored.step,
                "from_layout": restored.source_layout.to_json(),
                "to_layout": self.groups.layout.to_json(),
                "time": time.time(),
            }
        )
        if self.rank == 0:
            st = restored.stats
            log.info(
                "starting from %s (its step %d, layout %s) in layout %s: rank 0 read %.2f MB in %.2f s",
                restored.location,
                restored.step,
                restored.source_layout,
                self.groups.layout,
                st.bytes_read / 1e6,
                st.seconds,
            )

    def _restore_newest_intact(self) -> Restored | None:
        """Load the newest committed checkpoint that reads back intact (collective); ``None`` for a fresh run.

        A damaged one (a checksum mismatch, a truncated file) is set aside and the previous one tried, so a
        corrupted file costs the steps since the checkpoint before it, not the run.
        """
        # Rank 0 decides, so every rank loads the same step even if a listing (S3) differs between ranks.
        candidates = collectives.broadcast_json(
            [[step, st.location] for step, st in reversed(committed_steps(self.config.run_dir))]
            if self.rank == 0
            else None,
            0,
            self.checkpoints.group,
        )
        if self.memory is not None:
            restored = self._restore_from_memory(not_before=candidates[0][0] if candidates else None)
            if restored is not None:
                self.resume_tier = "memory"
                return restored
        for step, location in candidates:
            try:
                restored = restore(
                    location,
                    self.optimizer,
                    model_json=self.spec.to_json(),
                    group=self.checkpoints.group,
                    reads=self.config.resume_reads,
                    reset_optimizer=self.config.reset_optimizer,
                )
                self.resume_tier = "storage"  # only a resume has a tier: a fresh start prints no restart phases
                return restored
            except DAMAGED_CHECKPOINT_ERRORS as e:
                # Every rank gets the same error class from a collective load, so all of them fall back together.
                self._set_aside_damaged(step, location, e)
        if candidates:
            raise ResumeError(
                f"{self.config.run_dir}: all {len(candidates)} committed checkpoints are damaged (see the "
                "'damaged_checkpoint' events in metrics.jsonl); restore one from a copy or start a new --run-dir"
            )
        return None

    def _restore_from_memory(self, *, not_before: int | None) -> Restored | None:
        """Load the newest memory checkpoint the nodes of this world hold between them, if it is not older than
        the newest persisted step (collective); ``None`` when there is none left (the fallback order, a damaged
        copy set aside at each turn, is :func:`~moeckpt.trainer.memory_tier.restore_newest`'s).

        Each writer's file is read by a rank whose node holds it and exchanged over the checkpoint group, so a
        node that holds none of it (a new node) still loads; it gets the step's index to plan with."""
        if self.memory is None:
            return None

        def load(location: str, readable) -> Restored:
            return restore(
                location,
                self.optimizer,
                model_json=self.spec.to_json(),
                group=self.checkpoints.group,
                reset_optimizer=self.config.reset_optimizer,
                readable=readable,
            )

        def rejected(step: int, error: str, problems: dict[str, list[str]]) -> None:
            self.metrics.write(
                {
                    "event": "damaged_checkpoint",
                    "tier": "memory",
                    "step": step,
                    "error": error,
                    "nodes": problems,
                    "time": time.time(),
                }
            )

        return restore_newest(
            self.memory, load, not_before=not_before, group=self.checkpoints.group, on_rejected=rejected
        )

    def _set_aside_damaged(self, step: int, location: str, error: Exception) -> None:
        """Resume found ``location`` damaged: record it, move it out of the way (rank 0) and let the caller try the
        previous checkpoint. Collective, so no rank lists the run directory before the move is done."""
        moved = None
        if self.rank == 0:
            moved = quarantine(location)
            log.warning(
                "checkpoint of step %d is damaged (%s); moved it to %s and resuming from the previous one",
                step,
                error,
                moved,
            )
            self.metrics.write(
                {
                    "event": "damaged_checkpoint",
                    "step": step,
                    "error": str(error),
                    "moved_to": moved,
                    "time": time.time(),
                }
            )
        collectives.broadcast_json(moved, 0, self.checkpoints.group)

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
        """This rank's local tensor of every logical tensor (parameters as they are, ZeRO parts joined)."""
        out: dict[str, torch.Tensor] = {name: p.detach() for name, p in self.model.named_parameters()}
        layout, rank = self.groups.layout, self.rank
        by_name: dict[str, dict] = {}
        for piece in self.optimizer.pieces():
            by_name.setdefault(piece.name, {})[piece.box] = piece.tensor
        for name, entry in self.tensors.items():
            if entry.role != "param":
                out[name] = join_local(entry, layout, rank, by_name.get(name, {}))
        return out

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

    def _faults(self, config: TrainConfig) -> FaultInjector:
        marker_dir = None if is_url(config.run_dir) else config.run_dir
        return FaultInjector([parse_fault(f) for f in config.inject], rank=self.rank, marker_dir=marker_dir)

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
        stats = self.checkpoints.save(
            self.step, self.local_state(), self.train_state(), persist=persist, to_memory=memory
        )
        self.last_save = stats
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
        meter = _Progress(self, stop)
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
                    self.step % cfg.memory_every == 0 if cfg.memory_every else persist
                )
                if persist or memory:
                    record["save_blocked_s"] = self.save(persist=persist, memory=memory)
                    if self.last_save.skipped:
                        record["memory_skipped"] = True
                    if persist:
                        last_saved = self.step
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
        finally:
            if watchdog is not None:
                watchdog.stop()
            self.metrics.flush()
        return records

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

    def roll_back(self, loss: float) -> None:
        """NaN/Inf loss: reload the last checkpoint but keep the data position, so the batches since it are
        skipped (a bad batch window is the usual cause); stop with a report after ``max_nan_rollbacks`` tries."""
        cfg = self.config
        self.nan_rollbacks += 1
        self.checkpoints.wait()
        if self.nan_rollbacks > cfg.max_nan_rollbacks:
            raise NonFiniteLossError(
                f"step {self.step}: loss is {loss} and {cfg.max_nan_rollbacks} rollbacks did not help; lower --lr or "
                f"check the data near sample {self.loader.consumed_samples}. The checkpoints in {cfg.run_dir} are intact"
            )
        position = self.loader.state_dict()
        restored = self._restore_newest_intact()
        if restored is None:
            raise NonFiniteLossError(
                f"step {self.step}: loss is {loss} and there is no checkpoint to roll back to; lower --lr or check "
                f"the data near sample {self.loader.consumed_samples}"
            )
        self.step = int(restored.train_state.get("step", restored.step))
        self.schedule.steps = int(restored.train_state.get("schedule", {}).get("steps", self.step))
        self.loader.load_state_dict(position)  # skip the window: continue after the bad batch
        if self.rank == 0:
            log.warning(
                "loss %s: rolled back to %s (step %d), skipping to sample %d (rollback %d of %d)",
                loss,
                restored.location,
                self.step,
                self.loader.consumed_samples,
                self.nan_rollbacks,
                cfg.max_nan_rollbacks,
            )
        self.metrics.write(
            {
                "step": self.step,
                "event": "nan_rollback",
                "bad_loss": str(loss),
                "consumed_samples": self.loader.consumed_samples,
            }
        )

    def close(self) -> None:
        self.checkpoints.close()


def train(config: TrainConfig) -> list[dict[str, Any]]:
    """Run (or continue) training on this rank; every rank of the world calls it. Returns this rank's records."""
    return run_training(config).records


def run_training(config: TrainConfig) -> RunSummary:
    """:func:`train`, returning what the invocation did: its records, the step it ended at, and whether a SIGTERM
    stopped it (every rank of the world calls it)."""
    marks = {"process_start": process_start_time(), "entered": time.time()}
    device = setup_world(config)
    marks["world_joined"] = time.time()
    trainer = Trainer(config, device=device, marks=marks)
    preempted = PreemptionFlag()  # SIGTERM: save at the next step boundary, then exit 0
    # Its own CPU group: the checkpoint group is busy with background saves, and the training group may be NCCL.
    control = dist.new_group(backend="gloo") if dist.is_initialized() else None
    try:
        records = trainer.run(should_stop=lambda: preempted.agreed(control))
        if trainer.memory is not None and not trainer.stopped_early:
            # the invocation ended normally, its last step persisted: the memory tier has nothing more to give.
            # Stopped by SIGTERM (the agent re-forming the world, a preemption) it stays for the next world.
            trainer.memory.remove_all()
        if trainer.stopped_early and trainer.rank == 0:
            log.info(
                "stopped on SIGTERM at step %d%s",
                trainer.step,
                ", its checkpoint committed" if records else " before training a step: nothing new to save",
            )
        return RunSummary(records=records, step=trainer.step, preempted=trainer.stopped_early)
    finally:
        preempted.restore()
        trainer.close()


class _Progress:
    """The live progress lines of rank 0: every ``log_every`` steps, step/total, loss, lr, gradient norm,
    throughput, time blocked by saves and the time left at the recent pace."""

    def __init__(self, trainer: Trainer, stop: int) -> None:
        self.every = trainer.config.log_every if trainer.rank == 0 else 0
        self.total = trainer.config.steps
        self.stop = stop
        self.first_step = trainer.step
        self.t0 = time.perf_counter()
        self.blocked = 0.0

    def step(self, record: dict[str, Any]) -> None:
        if not self.every:
            return
        self.blocked += record["save_blocked_s"]
        step = record["step"]
        if step % self.every:
            return
        elapsed = time.perf_counter() - self.t0
        done = step - self.first_step
        eta = elapsed / done * (self.stop - step) if done > 0 else 0.0
        progress().info(
            "step %d/%d  loss %.4f  lr %.2e  grad norm %.3f  %s tok/s  save blocked %.2f s  ETA %s",
            step,
            self.total,
            record["loss"],
            record["lr"],
            record["grad_norm"],
            _si(record["tokens_per_s"]),
            self.blocked,
            _duration(eta),
        )
        self.blocked = 0.0


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
