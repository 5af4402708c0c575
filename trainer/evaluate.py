"""Evaluation: the mean token cross-entropy of a checkpoint's model on a token file, in any layout.

Every rank of the world (one process, or torchrun's) calls :func:`evaluate`. The model is rebuilt from the
checkpoint's index, sharded in this run's layout ``(tp, ep, dp = world / tp)``, and its parameters are loaded with
load-time resharding (each rank reads only its boxes, collectively over a gloo group). Batches are read exactly as
the trainer reads them (:class:`~moeckpt.trainer.data.BatchLoader`: a global sample position, split over dp), so
evaluating at a run's sample position with its seed reproduces the loss the trainer logged for that step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.local import split_local

from .data import BatchLoader, TokenDataset
from .distributed import build_parallel_model
from .models import ModelSpec
from .optim import StatePiece
from .parallel import build_groups, choose_layout, default_device, init_from_env
from .resume import ResumeError, exchanges, load_pieces

__all__ = ["EvalConfig", "check_launch", "evaluate"]


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What to evaluate and on which samples; the ``moeckpt eval`` options map one-to-one onto these fields."""

    #: a checkpoint directory, or a run directory (its newest committed step); local path or URL.
    checkpoint: str
    #: token file (``.bin`` uint16 or ``.txt`` bytes).
    data: str
    #: token dtype of ``data`` (``auto`` from the extension).
    data_dtype: str = "auto"
    #: tensor-parallel degree of the evaluation (any; the checkpoint is resharded at load).
    tp: int = 1
    #: expert-parallel degree of the evaluation (divides world / tp).
    ep: int = 1
    #: tokens per sample; default: the checkpoint's training seq_len (else 64).
    seq_len: int | None = None
    #: samples per batch over all ranks; default: the checkpoint's global batch (else 8).
    batch_size: int | None = None
    #: number of batches; the loss is the mean over all their tokens.
    batches: int = 4
    #: first global sample to read.
    start_sample: int = 0
    #: read samples in the shuffled order of ``seed`` (as the trainer does) instead of file order.
    shuffle: bool = False
    #: seed of the shuffled order; default: the checkpoint's training seed (else 0).
    seed: int | None = None
    #: force the CPU even when a GPU is visible.
    cpu: bool = False

    def __post_init__(self) -> None:
        if type(self.batches) is not int or self.batches < 1:
            raise ValueError(f"batches={self.batches!r} must be a positive integer")
        if type(self.start_sample) is not int or self.start_sample < 0:
            raise ValueError(f"start_sample={self.start_sample!r} must be a non-negative integer")
        for name in ("tp", "ep"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")


def check_launch(config: EvalConfig, nproc: int) -> None:
    """Refuse, before any process starts, a checkpoint, layout or data file that cannot work with ``nproc``."""
    reader = CheckpointReader(config.checkpoint)
    spec = ModelSpec.from_json(reader.index.model)
    choose_layout(nproc, tp=config.tp, ep=config.ep, check=spec.check_layout)
    seq_len = config.seq_len or int((reader.index.train_state or {}).get("seq_len", 64))
    TokenDataset(config.data, seq_len=seq_len, dtype=config.data_dtype, vocab_size=getattr(spec.config, "vocab_size", None))


def _param_pieces(model: torch.nn.Module, specs, layout, rank: int) -> list[StatePiece]:
    pieces = []
    params = dict(model.named_parameters())
    for spec in specs:
        entry = TensorEntry(name=spec.name, shape=tuple(spec.shape), dtype="float32", role="param", param=spec.name,
                            sharding=spec.rule.to_json())
        local = params[spec.name].detach()
        pieces.extend(StatePiece(spec.name, "param", box, view) for box, view in split_local(entry, layout, rank, local))
    return pieces


@torch.no_grad()
def eval_shape(config: EvalConfig, train_state: dict) -> tuple[int, int]:
    """(samples per batch, tokens per sample) of an evaluation: the config's, else the checkpoint's training ones."""
    return (config.batch_size or int(train_state.get("global_batch", 8)),
            config.seq_len or int(train_state.get("seq_len", 64)))


def evaluate(config: EvalConfig) -> float:
    """Mean token cross-entropy (nats) of the checkpoint on ``config``'s batches; the same value on every rank."""
    if dist.is_initialized() or _under_torchrun():
        device = init_from_env()
    else:
        device = default_device()
    device = torch.device("cpu") if config.cpu else device
    reader = CheckpointReader(config.checkpoint)
    spec = ModelSpec.from_json(reader.index.model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = choose_layout(world, tp=config.tp, ep=config.ep, check=spec.check_layout)
    groups = build_groups(layout, device=device)
    rank = groups.coords.rank
    model = build_parallel_model(spec, groups)
    specs = spec.param_specs()
    dtype = next(e.dtype for e in reader.index.tensors.values() if e.role == "param")
    model = model.to(device=device, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32)
    model.eval()
    # A dedicated gloo group for the collective read: the training world may be NCCL on GPUs.
    io_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    pieces = _param_pieces(model, specs, layout, rank)
    exchange = exchanges("auto", reader.location, io_group)  # as a resume's --resume-reads auto
    loaded = load_pieces(reader, pieces, layout, rank, roles=("param",), group=io_group, exchange=exchange)
    missing = sorted({p.name for p in pieces} - loaded)
    if missing:
        raise ResumeError(f"{reader.location}: the checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")

    state = reader.index.train_state or {}
    batch, seq_len = eval_shape(config, state)
    seed = config.seed if config.seed is not None else int(state.get("seed", 0))
    vocab = getattr(spec.config, "vocab_size", None)
    dataset = TokenDataset(config.data, seq_len=seq_len, dtype=config.data_dtype, vocab_size=vocab)
    loader = BatchLoader(dataset, global_batch=batch, dp_rank=groups.coords.dp_rank, dp=layout.dp, seed=seed,
                         shuffle=config.shuffle)
    loader.consumed_samples = config.start_sample
    total = torch.zeros(1, dtype=torch.float64, device=device)
    with torch.no_grad():  # evaluation builds no graph (and keeps none alive across batches)
        for _ in range(config.batches):
            inputs, targets = loader.next()
            total += model.loss(inputs.to(device), targets.to(device)).double()
    if layout.dp > 1:
        dist.all_reduce(total, group=groups.dp)
    # Every rank's batch has the same number of target tokens, so the mean of means is the token mean.
    return float(total) / (config.batches * layout.dp)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
