"""The training loop: a model shard per rank, ZeRO-1 AdamW, checkpoints through moeckpt, automatic resume.

One process per rank (torchrun, or :func:`moeckpt.testing.run_local_world` in tests); each calls
:func:`train` with the same :class:`TrainConfig`. The layout is ``(tp, ep, dp = world / tp)``. A run directory holds
``step-XXXXXXXX`` checkpoints and ``metrics.jsonl``; starting :func:`train` on a run directory that already has a
committed checkpoint continues from the newest one, in whatever layout this invocation has (load-time resharding).

Everything that decides the numbers is a function of the config and the step, never of the layout: the initial
weights (``(seed, tensor name)``, as ``moeckpt init``), the samples of each step (a global sample counter), the
learning rate (a pure function of the step). So the same run in another layout gives the same losses up to
floating-point reduction order, and a resume in the same layout continues bit for bit.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch
import torch.distributed as dist

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps, quarantine
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import INDEX_NAME, TensorEntry
from moeckpt.formats.retention import RetentionPolicy
from moeckpt.formats.storage import Storage, is_url
from moeckpt.reshard.local import join_local
from moeckpt.reshard.tensors import logical_tensors

from moeckpt.reshard import collectives
from .checkpointing import CheckpointManager
from .faults import FaultInjector, parse_fault
from .preemption import PreemptionFlag
from .watchdog import Watchdog
from .data import BatchLoader, DataError, TokenDataset, default_text_path
from .distributed import build_parallel_model
from .init_values import initial_value
from .metrics import MetricsLog
from .models import ModelSpec, resolve_model
from .optim import AdamWConfig, ZeroAdamW
from .parallel import ParallelGroups, build_groups, choose_layout, init_from_env
from .resume import DAMAGED_CHECKPOINT_ERRORS, Restored, ResumeError, restore
from .schedule import LRSchedule, ScheduleConfig

__all__ = ["DTYPES", "NonFiniteLossError", "TrainConfig", "Trainer", "check_launch", "train"]

#: ``--dtype`` values and the parameter dtype they select.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class NonFiniteLossError(MoeckptError, FloatingPointError):
    """The loss became NaN or infinite; the run stops without saving the broken state."""

    exit_code = 1


#: values of ``TrainConfig.resume_reads``.
RESUME_READS = ("auto", "exchange", "own")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run needs; the ``moeckpt train`` options map one-to-one onto these fields."""

    #: preset name (``zaya-tiny``, ``qwen3moe-tiny``, ...) or a model config.json; empty with ``init_from``: the
    #: model of that checkpoint.
    model: str
    #: run directory (local path or fsspec URL): checkpoints and ``metrics.jsonl``.
    run_dir: str
    #: token file (``.bin`` uint16, or ``.txt`` bytes); default: the shipped demo text.
    data: str | None = None
    #: token dtype of ``data`` (``auto`` from the extension, ``uint16``, ``uint32``, ``bytes``).
    data_dtype: str = "auto"
    #: tensor-parallel degree.
    tp: int = 1
    #: expert-parallel degree (divides dp = world / tp); ``None`` picks the widest the model accepts in each world
    #: (elastic runs whose world may shrink below a pinned ep).
    ep: int | None = 1
    #: total optimizer steps of the run; a resumed run continues up to it.
    steps: int = 100
    #: stop this invocation after this step (saving first), although the run's total is ``steps`` (planned
    #: interruptions, tests); ``None`` runs to ``steps``.
    stop_at: int | None = None
    #: save a checkpoint every this many steps (0: only at the end).
    save_every: int = 0
    #: checkpoint format: ``safetensors`` or ``zarr``.
    format: str = "safetensors"
    #: seed of the initial weights and of the data order.
    seed: int = 0
    #: samples per optimizer step over all data-parallel ranks.
    global_batch: int = 8
    #: tokens per sample.
    seq_len: int = 64
    #: peak learning rate.
    lr: float = 3e-3
    #: linear warmup steps.
    warmup_steps: int = 10
    #: the cosine decays to ``lr * min_lr_ratio`` at the last step.
    min_lr_ratio: float = 0.1
    #: AdamW decoupled weight decay (matrices only).
    weight_decay: float = 0.1
    #: gradient clipping by global norm (0 disables).
    max_grad_norm: float = 1.0
    #: parameter dtype: ``fp32`` or ``bf16`` (bf16 keeps fp32 master weights in the optimizer).
    dtype: str = "fp32"
    #: persist checkpoints in a background thread (training blocks only for the snapshot copy).
    async_save: bool = True
    #: keep this many newest checkpoints.
    keep_last: int = 3
    #: collective backend override (``gloo``/``nccl``); default from the device.
    backend: str | None = None
    #: force the CPU even when a GPU is visible.
    cpu: bool = False
    #: injected faults for tests and the demo, e.g. ``("kill:rank=1,step=12",)`` (see ``trainer/faults.py``).
    inject: tuple[str, ...] = ()
    #: end a worker whose step makes no progress for this many seconds, with a report (0: no watchdog).
    hang_timeout_s: float = 0.0
    #: NaN/Inf loss: roll back to the last checkpoint and skip the batches since, at most this many times.
    max_nan_rollbacks: int = 3
    #: a checkpoint (or run directory: its newest step) whose parameters and optimizer state start the run when
    #: ``run_dir`` holds no checkpoint yet, resharded to this run's layout; the run starts at step 0 with a fresh
    #: data position and schedule (fine-tuning an ``import-hf`` checkpoint). Ignored once ``run_dir`` has one.
    init_from: str | None = None
    #: how the ranks read a checkpoint they resume from: ``exchange`` replicated pieces over the process group
    #: (each stored byte read once per group), each rank reads its ``own`` bytes, or ``auto``: ``own`` when the
    #: checkpoint is on a local path and every rank runs on one host (its page cache already reads each byte from
    #: the device once; the exchange only adds copies), else ``exchange`` (see ``reshard.load.exchange_pays``).
    resume_reads: str = "auto"

    def __post_init__(self) -> None:
        if not self.model and not self.init_from:
            raise ValueError("model is empty: name a preset or config.json, or give init_from to take its model")
        if type(self.steps) is not int or self.steps < 1:
            raise ValueError(f"steps={self.steps!r} must be a positive integer")
        if self.stop_at is not None and not 0 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at={self.stop_at!r} must lie in [0, steps={self.steps}]")
        if self.save_every < 0:
            raise ValueError(f"save_every={self.save_every} must be >= 0")
        if self.format not in ("safetensors", "zarr"):
            raise ValueError(f"format={self.format!r} must be safetensors or zarr")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        for spec in self.inject:
            parse_fault(spec)
        if self.resume_reads not in RESUME_READS:
            raise ValueError(f"resume_reads={self.resume_reads!r} must be one of {', '.join(RESUME_READS)}")
        if self.hang_timeout_s < 0 or self.max_nan_rollbacks < 0:
            raise ValueError("hang_timeout_s and max_nan_rollbacks must be >= 0")
        for name in ("tp", "ep", "global_batch", "seq_len", "keep_last"):
            value = getattr(self, name)
            if name == "ep" and value is None:
                continue
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"train config has unknown fields {sorted(unknown)}")
        value = dict(value)
        value["inject"] = tuple(value.get("inject", ()))  # JSON has lists
        return cls(**value)


def run_model(config: TrainConfig) -> ModelSpec:
    """The run's model: ``config.model``, or the model of the ``init_from`` checkpoint when that is empty."""
    if config.model:
        return resolve_model(config.model)
    return ModelSpec.from_json(CheckpointReader(config.init_from).index.model)


def check_run_dir(config: TrainConfig) -> None:
    """Refuse a run directory that is itself a checkpoint: the run would ignore it and save steps inside it."""
    if Storage(config.run_dir).exists(INDEX_NAME):
        raise ResumeError(
            f"{config.run_dir}: is a checkpoint, not a run directory; to train from it pass --init-from "
            f"{config.run_dir} with a new --run-dir"
        )


def check_launch(config: TrainConfig, nproc: int) -> None:
    """Refuse, before any process starts, a model, layout or data file that cannot work with ``nproc`` processes
    (each worker would otherwise fail alone, behind torchrun's generic exit code)."""
    check_run_dir(config)
    spec = run_model(config)
    layout = choose_layout(nproc, tp=config.tp, ep=config.ep, check=spec.check_layout)
    if config.global_batch % layout.dp:
        raise DataError(
            f"global_batch={config.global_batch} is not divisible by dp = nproc / tp = {layout.dp}: every "
            "data-parallel rank must read the same number of samples"
        )
    TokenDataset(config.data or default_text_path(), seq_len=config.seq_len, dtype=config.data_dtype,
                 vocab_size=getattr(spec.config, "vocab_size", None))


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

    def __init__(self, config: TrainConfig, *, device: torch.device | None = None) -> None:
        self.config = config
        check_run_dir(config)
        self.spec: ModelSpec = run_model(config)
        world = dist.get_world_size() if dist.is_initialized() else 1
        layout = choose_layout(world, tp=config.tp, ep=config.ep, check=self.spec.check_layout)
        device = device or torch.device("cpu")
        self.groups: ParallelGroups = build_groups(layout, device=device)
        self.rank = self.groups.coords.rank
        self.device = device
        dtype = DTYPES[config.dtype]

        self.model = build_parallel_model(self.spec, self.groups).to(device=device, dtype=dtype)
        self.model.train()
        params = self.spec.param_specs()
        self.optimizer = ZeroAdamW(
            self.model.named_parameters(),
            params,
            self.groups,
            AdamWConfig(weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm or None),
        )
        self._init_weights(params)
        warmup = min(config.warmup_steps, config.steps)
        self.schedule = LRSchedule(
            ScheduleConfig(lr=config.lr, warmup_steps=warmup, decay_steps=config.steps, min_lr_ratio=config.min_lr_ratio)
        )
        vocab = getattr(self.spec.config, "vocab_size", None)
        dataset = TokenDataset(config.data or default_text_path(), seq_len=config.seq_len, dtype=config.data_dtype,
                               vocab_size=vocab)
        self.loader = BatchLoader(
            dataset,
            global_batch=config.global_batch,
            dp_rank=self.groups.coords.dp_rank,
            dp=layout.dp,
            seed=config.seed,
        )
        param_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
        self.tensors: dict[str, TensorEntry] = logical_tensors(params, param_dtype=param_dtype, with_optimizer=True)
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
        self.nan_rollbacks = 0
        self.step = 0
        self.resumed_from: str | None = None
        self._resume()

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
                entry = TensorEntry(name=spec.name, shape=tuple(spec.shape), dtype="float32", role="param",
                                    param=spec.name)
                current = (piece.param, initial_value(entry, seed=self.config.seed, std=std))
            piece.tensor.copy_(current[1][piece.box.slices()])
        self.optimizer.load_master_from_params()

    def _resume(self) -> None:
        restored = self._restore_newest_intact()
        if restored is None:
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
        self.metrics.write({
            "event": "resume", "step": self.step, "from_layout": restored.source_layout.to_json(),
            "to_layout": self.groups.layout.to_json(),
            # storage reads of all ranks against the bytes the new layout holds (replicas counted once per rank)
            "bytes_read": sum(r[0] for r in everyone), "bytes_needed": sum(r[1] for r in everyone),
            "state_bytes": sum(e.nbytes for e in self.tensors.values()), "exchanged": restored.exchanged,
            "time": time.time(),
            "seconds": max(r[2] for r in everyone),
        })
        if self.rank == 0:
            st = restored.stats
            print(
                f"moeckpt: resumed {restored.location} (step {self.step}, written in layout {restored.source_layout}) "
                f"into layout {self.groups.layout}: rank 0 read {st.bytes_read / 1e6:.2f} MB for "
                f"{st.bytes_needed / 1e6:.2f} MB of state in {st.seconds:.2f} s",
                file=sys.stderr,
                flush=True,
            )

    def _start_from(self, location: str) -> None:
        """Load ``init_from``'s parameters and optimizer state (resharded, collective); the run starts at step 0."""
        restored = restore(location, self.optimizer, model_json=self.spec.to_json(), group=self.checkpoints.group,
                reads=self.config.resume_reads)
        self.metrics.write({
            "event": "init_from", "location": restored.location, "checkpoint_step": restored.step,
            "from_layout": restored.source_layout.to_json(), "to_layout": self.groups.layout.to_json(),
            "time": time.time(),
        })
        if self.rank == 0:
            st = restored.stats
            print(
                f"moeckpt: starting from {restored.location} (its step {restored.step}, layout "
                f"{restored.source_layout}) in layout {self.groups.layout}: rank 0 read {st.bytes_read / 1e6:.2f} MB "
                f"in {st.seconds:.2f} s",
                file=sys.stderr,
                flush=True,
            )

    def _restore_newest_intact(self) -> Restored | None:
        """Load the newest committed checkpoint that reads back intact (collective); ``None`` for a fresh run.

        A damaged one (a checksum mismatch, a truncated file) is set aside and the previous one tried, so a
        corrupted file costs the steps since the checkpoint before it, not the run.
        """
        # Rank 0 decides, so every rank loads the same step even if a listing (S3) differs between ranks.
        candidates = collectives.broadcast_json(
            [[step, st.location] for step, st in reversed(committed_steps(self.config.run_dir))]
            if self.rank == 0 else None, 0, self.checkpoints.group,
        )
        for step, location in candidates:
            try:
                return restore(location, self.optimizer, model_json=self.spec.to_json(), group=self.checkpoints.group,
                reads=self.config.resume_reads)
            except DAMAGED_CHECKPOINT_ERRORS as e:
                # Every rank gets the same error class from a collective load, so all of them fall back together.
                self._set_aside_damaged(step, location, e)
        if candidates:
            raise ResumeError(
                f"{self.config.run_dir}: all {len(candidates)} committed checkpoints are damaged (see the "
                "'damaged_checkpoint' events in metrics.jsonl); restore one from a copy or start a new --run-dir"
            )
        return None

    def _set_aside_damaged(self, step: int, location: str, error: Exception) -> None:
        """Resume found ``location`` damaged: record it, move it out of the way (rank 0) and let the caller try the
        previous checkpoint. Collective, so no rank lists the run directory before the move is done."""
        moved = None
        if self.rank == 0:
            moved = quarantine(location)
            print(f"moeckpt: warning: checkpoint of step {step} is damaged ({error}); moved it to {moved} and "
                  "resuming from the previous one", file=sys.stderr, flush=True)
            self.metrics.write({"event": "damaged_checkpoint", "step": step, "error": str(error),
                                "moved_to": moved, "time": time.time()})
        collectives.broadcast_json(moved, 0, self.checkpoints.group)

    # ------------------------------------------------------------------------------------------- steps

    def train_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumed_samples": self.loader.consumed_samples,
            "data": self.loader.state_dict(),
            "schedule": self.schedule.state_dict(),
            "optimizer": self.optimizer.state_dict(),
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
        faults.before_step(self.step + 1)
        inputs, targets = self.loader.next()
        loss = faults.loss(self.step + 1, self.loss(inputs, targets))
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

    def save(self) -> float:
        """Start a checkpoint of the current step; returns the seconds training was blocked."""
        stats = self.checkpoints.save(self.step, self.local_state(), self.train_state())
        return stats.blocked_s

    def run(self, *, should_stop: Callable[[], bool] | None = None) -> list[dict[str, Any]]:
        """Train up to ``stop_at`` (or ``steps``), saving every ``save_every`` steps and at the end.

        ``should_stop`` is asked after every step; ``True`` saves and returns early (a SIGTERM handler's flag, say).
        It must answer the same on every rank at the same step (agree with an all-reduce first), since saving is
        collective.
        """
        cfg = self.config
        stop = cfg.steps if cfg.stop_at is None else cfg.stop_at
        last_saved = self.step if self.resumed_from else None
        records = []
        watchdog = None
        if cfg.hang_timeout_s:
            report = None if is_url(cfg.run_dir) else os.path.join(cfg.run_dir, f"hang-rank{self.rank}.txt")
            watchdog = Watchdog(cfg.hang_timeout_s, report_path=report).start()
        try:
            while self.step < stop:
                record = self.train_step()
                if watchdog is not None:
                    watchdog.beat(f"step {self.step}")
                if not math.isfinite(record["loss"]):
                    self.roll_back(record["loss"])
                    continue
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == stop:
                    record["save_blocked_s"] = self.save()
                    last_saved = self.step
                self.metrics.write(record)
                records.append(record)
                if record["save_blocked_s"]:
                    self.metrics.flush()
                if should_stop is not None and self.step < stop and should_stop():
                    break
            if last_saved != self.step:
                self.save()
            self.checkpoints.wait()
        finally:
            if watchdog is not None:
                watchdog.stop()
            self.metrics.flush()
        return records

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
            print(f"moeckpt: loss {loss} at step {self.step}: rolled back to {restored.location} (step {self.step}), "
                  f"skipping to sample {self.loader.consumed_samples} (rollback {self.nan_rollbacks} of "
                  f"{cfg.max_nan_rollbacks})", file=sys.stderr, flush=True)
        self.metrics.write({"step": self.step, "event": "nan_rollback", "bad_loss": str(loss),
                            "consumed_samples": self.loader.consumed_samples})

    def close(self) -> None:
        self.checkpoints.close()


def train(config: TrainConfig) -> list[dict[str, Any]]:
    """Run (or continue) training on this rank; every rank of the world calls it. Returns this rank's records."""
    device = setup_world(config)
    trainer = Trainer(config, device=device)
    preempted = PreemptionFlag()  # SIGTERM: save at the next step boundary, then exit 0
    # Its own CPU group: the checkpoint group is busy with background saves, and the training group may be NCCL.
    control = dist.new_group(backend="gloo") if dist.is_initialized() else None
    try:
        return trainer.run(should_stop=lambda: preempted.agreed(control))
    finally:
        preempted.restore()
        trainer.close()
