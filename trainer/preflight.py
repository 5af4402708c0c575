"""What a run is refused for before it allocates: a run directory that is a checkpoint, a model, layout, data file,
batch or memory budget that cannot work (:func:`check_launch` before any process starts, :func:`check_shape` on
each rank before it builds the model), and the run's model (:func:`run_model`) and data (:func:`open_dataset`).

Each worker would otherwise fail alone, behind torchrun's generic exit code, or be found by the OOM killer after
minutes of allocation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import INDEX_NAME
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.state_dict_checkpoints import is_state_dict

from .config import DTYPES as CONFIG_DTYPES
from .config import TrainConfig
from .data import DataError, TokenDataset, default_text_path
from .memory import check_fits, training_bytes
from .memory_tier import check_host_budget
from .models import ModelSpec, resolve_model
from .optimizer_choice import check_run_optimizer
from .parallel import choose_layout
from .resume import ResumeError

__all__ = ["DTYPES", "check_launch", "check_run_dir", "check_shape", "open_dataset", "run_model"]

#: ``--dtype`` values and the parameter dtype they select.
DTYPES = {short: dtypes.to_torch(name) for short, name in dtypes.short_names(*CONFIG_DTYPES).items()}


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
