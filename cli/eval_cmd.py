"""``moeckpt eval``: mean token cross-entropy of a checkpoint on a token file, in any layout."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.trainer.eval_config import EvalConfig
from moeckpt.trainer.launch import LaunchFailedError, run_torchrun, under_torchrun

from .common import progress
from .config_options import SectionedCommand, config_from_options, config_options
from .params import Text, count


def _check_data(config) -> None:
    """--data must be a token file the checkpoint's model can read (one line naming --data if not)."""
    from moeckpt.trainer.data import DataError, TokenDataset
    from moeckpt.trainer.evaluate import eval_shape
    from moeckpt.trainer.models import ModelSpec

    reader = CheckpointReader(config.checkpoint)
    spec = ModelSpec.from_json(reader.index.model)
    _, seq_len = eval_shape(config, reader.index.train_state or {})
    try:
        TokenDataset(
            config.data_path,
            seq_len=seq_len,
            dtype=config.data_dtype,
            vocab_size=getattr(spec.config, "vocab_size", None),
        )
    except DataError as e:
        raise click.BadParameter(str(e), param_hint="'--data'") from None


@click.command("eval", cls=SectionedCommand)
@click.argument("ckpt", type=Text())
@config_options(EvalConfig, skip=("checkpoint",))
@click.option(
    "--nproc",
    type=count(1, 1024),
    default=1,
    show_default=True,
    help="local processes (starts torchrun's agent when > 1)",
)
@click.option("--json", "as_json", is_flag=True, help='print {"loss": ..., "tokens": ...} as JSON')
def command(ckpt, nproc, as_json, **values) -> None:
    """Print the mean token cross-entropy of checkpoint CKPT (or a run directory's newest step) on DATA."""
    from moeckpt.trainer.evaluate import check_launch, eval_shape, evaluate

    config = config_from_options(EvalConfig, {**values, "checkpoint": ckpt})
    _check_data(config)
    epoch = check_launch(config, nproc)
    if nproc > 1 and not under_torchrun():
        result = run_torchrun("eval", asdict(config), nproc)
        status = result.rank0()
        if status is None or "loss" not in status:
            raise LaunchFailedError(f"the {nproc} eval workers ended without rank 0 reporting a loss")
        loss = status["loss"]
    else:
        with progress(config.batches, "eval", unit="batch") as bar:
            loss = evaluate(config, on_batch=lambda: bar.update(1))
        if os.environ.get("RANK", "0") != "0":
            return
    batch, seq_len = eval_shape(config, CheckpointReader(ckpt).index.train_state or {})
    tokens = config.batches * batch * seq_len
    where = config.data_path
    later = f", up to epoch {epoch} of the shuffled order" if epoch else ""
    click.echo(
        json.dumps({"loss": loss, "tokens": tokens})
        if as_json
        else f"{ckpt}: mean token cross-entropy {loss:.6f} nats over {tokens} tokens of {where} "
        f"({config.batches} batches of {batch} x {seq_len}{later}; --batches for more)"
    )
