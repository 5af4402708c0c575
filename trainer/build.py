"""Building one rank's training state, step by step: its place in the layout (process groups), the model shard,
the optimizer, the LR schedule, the data loader, the checkpoint manager, the memory tier, and (for a fresh start)
the layout-free initial weights. :class:`~moeckpt.trainer.step_loop.Trainer` calls them in this order.

Several steps are collective (they make process groups or agree on the run's id), so every rank calls them in the
same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeckpt.formats.index import TensorEntry
from moeckpt.formats.retention import RetentionPolicy
from moeckpt.formats.storage import is_url
from moeckpt.reshard import collectives
from moeckpt.reshard.layout import Layout

from .adamw import AdamWConfig
from .checkpointing import CheckpointManager
from .config import TrainConfig
from .data import BatchLoader, TokenDataset
from .distributed import build_parallel_model
from .faults import FaultInjector, parse_fault
from .init_values import initial_value
from .memory_tier import MemoryTier, run_id, run_root
from .models import ModelSpec
from .muon import MuonConfig
from .optimizer_choice import build_optimizer
from .parallel import ParallelGroups, build_groups, choose_layout
from .schedule import LRSchedule, ScheduleConfig

__all__ = [
    "build_checkpoints",
    "build_loader",
    "build_model",
    "build_run_optimizer",
    "build_schedule",
    "init_weights",
    "join_layout",
    "join_memory_tier",
]


def join_layout(config: TrainConfig, spec: ModelSpec, device: torch.device) -> tuple[Layout, ParallelGroups]:
    """This world's layout ``(tp, ep, dp = world / tp)`` and its process groups (collective)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = choose_layout(world, tp=config.tp, ep=config.ep, check=spec.check_layout)
    return layout, build_groups(layout, device=device)


def build_model(spec: ModelSpec, groups: ParallelGroups, device: torch.device, dtype: torch.dtype):
    """This rank's model shard, in training mode."""
    # Made where it trains: the plan's initial fill runs on the device, and nothing is copied there after.
    with torch.device(device):
        model = build_parallel_model(spec, groups)
    model = model.to(device=device, dtype=dtype)
    model.train()
    return model


def build_run_optimizer(config: TrainConfig, model, params, groups: ParallelGroups, *, held=()):
    """The run's optimizer (``--optimizer``) over this rank's parameters, its state sharded ZeRO-1; ``held``
    (the model's ``untrained()`` parameters) are saved and restored but never stepped."""
    return build_optimizer(
        config.optimizer,
        model.named_parameters(),
        params,
        groups,
        AdamWConfig(weight_decay=config.weight_decay, max_grad_norm=config.max_grad_norm or None),
        muon=MuonConfig(momentum=config.muon_momentum, ns_steps=config.muon_ns_steps, scheme=config.muon_scheme),
        held=held,
    )


def build_schedule(config: TrainConfig) -> LRSchedule:
    """The learning rate as a pure function of the step: warmup, then cosine decay over ``steps``."""
    warmup = min(config.warmup_steps, config.steps)
    return LRSchedule(
        ScheduleConfig(lr=config.lr, warmup_steps=warmup, decay_steps=config.steps, min_lr_ratio=config.min_lr_ratio)
    )


def build_loader(config: TrainConfig, dataset: TokenDataset, groups: ParallelGroups) -> BatchLoader:
    """This data-parallel rank's share of every global batch."""
    return BatchLoader(
        dataset,
        global_batch=config.global_batch,
        dp_rank=groups.coords.dp_rank,
        dp=groups.layout.dp,
        seed=config.seed,
    )


def build_checkpoints(
    config: TrainConfig, tensors: dict[str, TensorEntry], layout: Layout, spec: ModelSpec, *, rank: int
) -> CheckpointManager:
    """The run directory's checkpoint manager, with the run's fault injection (``--inject``)."""
    return CheckpointManager(
        config.run_dir,
        tensors=tensors,
        layout=layout,
        model=spec.to_json(),
        backend=config.format,
        compress=config.compress,
        retention=RetentionPolicy(keep_last=config.keep_last),
        async_save=config.async_save,
        faults=_faults(config, rank, layout.world),
    )


def _faults(config: TrainConfig, rank: int, world: int) -> FaultInjector:
    marker_dir = None if is_url(config.run_dir) else config.run_dir
    return FaultInjector([parse_fault(f) for f in config.inject], rank=rank, marker_dir=marker_dir, world=world)


def join_memory_tier(config: TrainConfig, rank: int, tensors: dict[str, TensorEntry], group) -> MemoryTier:
    """Join the memory tier (collective over ``group``, the checkpoint manager's): the run's id from its run
    directory, the budget checked."""
    rid = collectives.broadcast_json(run_id(config.run_dir, create=True) if rank == 0 else None, 0, group)
    # Its own gloo group: a memory-only save is written beside a persistent one still in flight (which talks
    # over the checkpoint manager's group), never behind it.
    tier_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    tier = MemoryTier(
        run_root(config.memory_dir, rid),
        group=tier_group,
        keep=config.memory_keep,
        replicas=config.memory_replicas,
        state_bytes=sum(e.nbytes for e in tensors.values()),
    )
    tier.check_budget()
    return tier


@torch.no_grad()
def init_weights(optimizer, spec: ModelSpec, params, *, seed: int) -> None:
    """Overwrite the randomly initialised tensors with values that depend on (seed, name) only, so every
    layout starts from the same model; ones/zeros (and model-specific constants) are layout-free already."""
    specs = {p.name: p for p in params}
    std = getattr(spec.config, "initializer_range", 0.02)
    current: tuple[str, torch.Tensor] | None = None  # one full tensor at a time: pieces come grouped by param
    for piece in optimizer.param_pieces():
        pspec = specs[piece.param]
        if pspec.init != "normal":
            continue
        if current is None or current[0] != piece.param:
            entry = TensorEntry(
                name=pspec.name, shape=tuple(pspec.shape), dtype="float32", role="param", param=pspec.name
            )
            current = (piece.param, initial_value(entry, seed=seed, std=std))
        piece.tensor.copy_(current[1][piece.box.slices()])
    optimizer.load_master_from_params()
