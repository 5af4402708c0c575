"""Evaluation: the mean token cross-entropy of a checkpoint's model on a token file, in any layout.

Every rank of the world (one process, or torchrun's) calls :func:`evaluate`. The model is rebuilt from the
checkpoint's index, sharded in this run's layout ``(tp, ep, dp = world / tp)``, and its parameters are loaded with
load-time resharding (each rank reads only its boxes, collectively over a gloo group). Batches are read exactly as
the trainer reads them (:class:`~moeckpt.trainer.data.BatchLoader`: a global sample position, split over dp), so
evaluating at a run's sample position with its seed reproduces the loss the trainer logged for that step.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.local import split_local

from .adamw import StatePiece
from .data import BatchLoader, DataError, TokenDataset
from .distributed import build_parallel_model
from .eval_config import EvalConfig
from .memory import check_fits, training_bytes
from .models import ModelSpec
from .parallel import build_groups, choose_layout, default_device, init_from_env
from .resume import ResumeError, exchanges, load_pieces

__all__ = ["EvalConfig", "check_launch", "evaluate"]


def check_samples(config: EvalConfig, dataset: TokenDataset, batch: int) -> int | None:
    """Refuse batches past the end of the data in file order; with ``shuffle`` a sample beyond the file belongs
    to a later epoch of the shuffled order (as the trainer reads it): returns the epoch of the first sample."""
    n = len(dataset)
    wanted = config.batches * batch
    if wanted > n:
        raise DataError(
            f"--batches {config.batches} of {batch} samples is {wanted} samples, more than the {n} samples of seq_len "
            f"{dataset.seq_len} in {dataset.path}; use at most --batches {max(1, n // batch)}"
        )
    if config.shuffle:
        return (config.start_sample + wanted - 1) // n if config.start_sample + wanted > n else None
    if config.start_sample + wanted > n:
        raise DataError(
            f"--start-sample {config.start_sample} plus {wanted} samples reads past the end of the {n} samples in "
            f"{dataset.path} (in file order); use --start-sample at most {n - wanted}, or --shuffle to read the "
            "trainer's shuffled order of later epochs"
        )
    return None


def check_launch(config: EvalConfig, nproc: int) -> int | None:
    """Refuse, before any process starts, a checkpoint, layout, data file or sample range that cannot work with
    ``nproc``; returns the epoch of the last sample when a shuffled read goes past the file's samples."""
    reader = CheckpointReader(config.checkpoint)
    spec = ModelSpec.from_json(reader.index.model)
    layout = choose_layout(nproc, tp=config.tp, ep=config.ep, check=spec.check_layout)
    batch, seq_len = eval_shape(config, reader.index.train_state or {})
    dataset = TokenDataset(
        config.data_path, seq_len=seq_len, dtype=config.data_dtype, vocab_size=getattr(spec.config, "vocab_size", None)
    )
    return _check(config, spec, layout, dataset, batch, ranks_here=nproc, device_type="cpu" if config.cpu else None)


def _check(
    config: EvalConfig,
    spec: ModelSpec,
    layout,
    dataset: TokenDataset,
    batch: int,
    *,
    ranks_here: int,
    device_type: str | None,
) -> int | None:
    if batch % layout.dp:
        raise DataError(f"--batch-size {batch} is not divisible by dp = nproc / tp = {layout.dp}")
    epoch = check_samples(config, dataset, batch)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    need = training_bytes(
        spec,
        tp=layout.tp,
        ep=layout.ep,
        dp=layout.dp,
        micro_batch=batch // layout.dp,
        seq_len=dataset.seq_len,
        param_bytes=4,
        optimizer=False,
    )
    check_fits(
        need,
        ranks_here=ranks_here,
        device_type=device_type,
        what=f"evaluating {spec.arch} in {layout}",
        fix="use a smaller --batch-size or --seq-len, or more ranks (--nproc, --tp, --ep)",
    )
    return epoch


def _param_pieces(model: torch.nn.Module, specs, layout, rank: int) -> list[StatePiece]:
    pieces: list[StatePiece] = []
    params = dict(model.named_parameters())
    for spec in specs:
        entry = TensorEntry(
            name=spec.name,
            shape=tuple(spec.shape),
            dtype="float32",
            role="param",
            param=spec.name,
            sharding=spec.rule.to_json(),
        )
        local = params[spec.name].detach()
        pieces.extend(
            StatePiece(spec.name, "param", box, view) for box, view in split_local(entry, layout, rank, local)
        )
    return pieces


@torch.no_grad()
def eval_shape(config: EvalConfig, train_state: dict) -> tuple[int, int]:
    """(samples per batch, tokens per sample) of an evaluation: the config's, else the checkpoint's training ones."""
    return (
        config.batch_size or int(train_state.get("global_batch", 8)),
        config.seq_len or int(train_state.get("seq_len", 64)),
    )


def evaluate(config: EvalConfig, *, on_batch: Callable[[], None] | None = None) -> float:
    """Mean token cross-entropy (nats) of the checkpoint on ``config``'s batches; the same value on every rank.

    ``on_batch`` is called after each batch (progress bars)."""
    if dist.is_initialized() or _under_torchrun():
        device = init_from_env()
    else:
        device = default_device()
    device = torch.device("cpu") if config.cpu else device
    reader = CheckpointReader(config.checkpoint)
    spec = ModelSpec.from_json(reader.index.model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = choose_layout(world, tp=config.tp, ep=config.ep, check=spec.check_layout)
    state = reader.index.train_state or {}
    batch, seq_len = eval_shape(config, state)
    vocab = getattr(spec.config, "vocab_size", None)
    dataset = TokenDataset(config.data_path, seq_len=seq_len, dtype=config.data_dtype, vocab_size=vocab)
    _check(
        config,
        spec,
        layout,
        dataset,
        batch,
        ranks_here=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device_type=device.type,
    )
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

    seed = config.seed if config.seed is not None else int(state.get("seed", 0))
    loader = BatchLoader(
        dataset, global_batch=batch, dp_rank=groups.coords.dp_rank, dp=layout.dp, seed=seed, shuffle=config.shuffle
    )
    loader.consumed_samples = config.start_sample
    total = torch.zeros(1, dtype=torch.float64, device=device)
    with torch.no_grad():  # evaluation builds no graph (and keeps none alive across batches)
        for _ in range(config.batches):
            inputs, targets = loader.next()
            total += model.loss(inputs.to(device), targets.to(device)).double()
            if on_batch is not None:
                on_batch()
    if layout.dp > 1:
        dist.all_reduce(total, group=groups.dp)
    # Every rank's batch has the same number of target tokens, so the mean of means is the token mean.
    return float(total) / (config.batches * layout.dp)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
