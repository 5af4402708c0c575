"""``moeckpt eval``: mean token cross-entropy of a checkpoint on a token file, in any layout."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.trainer.launch import LaunchFailedError, run_torchrun, under_torchrun

from .common import progress
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


@click.command("eval")
@click.argument("ckpt", type=Text())
@click.option(
    "--data",
    type=Text(),
    default=None,
    metavar="PATH",
    help="token file: .bin (uint16) or .txt (bytes)  [default: the shipped demo text, as train]",
)
@click.option(
    "--data-dtype",
    type=click.Choice(["auto", "uint16", "uint32", "bytes"]),
    default="auto",
    show_default=True,
    help="token dtype of --data (auto: from the extension)",
)
@click.option(
    "--tp", type=count(1, 4096), default=1, show_default=True, help="tensor-parallel degree of the evaluation"
)
@click.option(
    "--ep", type=count(1, 4096), default=1, show_default=True, help="expert-parallel degree (divides nproc / tp)"
)
@click.option(
    "--nproc",
    type=count(1, 1024),
    default=1,
    show_default=True,
    help="local processes (starts torchrun's agent when > 1)",
)
@click.option("--seq-len", type=count(1, 2**20), default=None, help="tokens per sample  [default: the run's]")
@click.option(
    "--batch-size", type=count(1, 2**24), default=None, help="samples per batch  [default: the run's global batch]"
)
@click.option(
    "--batches",
    type=count(1),
    default=4,
    show_default=True,
    help="batches to average over (together at most the samples in --data)",
)
@click.option(
    "--start-sample",
    type=count(0, 2**62),
    default=0,
    show_default=True,
    help="first global sample (in file order the batches must end within the data)",
)
@click.option(
    "--shuffle", is_flag=True, help="read samples in the trainer's shuffled order (with --seed), epochs included"
)
@click.option("--seed", type=count(0, 2**63 - 1), default=None, help="seed of the shuffled order  [default: the run's]")
@click.option("--json", "as_json", is_flag=True, help='print {"loss": ..., "tokens": ...} as JSON')
@click.option("--cpu", is_flag=True, help="run on the CPU even when a GPU is visible")
def command(
    ckpt, data, data_dtype, tp, ep, nproc, seq_len, batch_size, batches, start_sample, shuffle, seed, as_json, cpu
) -> None:
    """Print the mean token cross-entropy of checkpoint CKPT (or a run directory's newest step) on DATA."""
    from moeckpt.trainer.evaluate import EvalConfig, check_launch, eval_shape, evaluate

    try:
        config = EvalConfig(
            checkpoint=ckpt,
            data=data,
            data_dtype=data_dtype,
            tp=tp,
            ep=ep,
            seq_len=seq_len,
            batch_size=batch_size,
            batches=batches,
            start_sample=start_sample,
            shuffle=shuffle,
            seed=seed,
            cpu=cpu,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
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
