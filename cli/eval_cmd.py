"""``moeckpt eval``: mean token cross-entropy of a checkpoint on a token file, in any layout."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.trainer.evaluate import EvalConfig, check_launch, eval_shape, evaluate
from moeckpt.trainer.launch import LaunchFailedError, run_torchrun, under_torchrun


@click.command("eval")
@click.argument("ckpt")
@click.option("--data", required=True, help="token file: .bin (uint16) or .txt (bytes)")
@click.option("--data-dtype", default="auto", show_default=True, help="token dtype of --data: auto, uint16, uint32, bytes")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="tensor-parallel degree of the evaluation")
@click.option("--ep", type=click.IntRange(min=1), default=1, show_default=True,
              help="expert-parallel degree (divides nproc / tp)")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="local processes (starts torchrun when > 1)")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="tokens per sample  [default: the run's]")
@click.option("--batch-size", type=click.IntRange(min=1), default=None,
              help="samples per batch  [default: the run's global batch]")
@click.option("--batches", type=click.IntRange(min=1), default=4, show_default=True, help="batches to average over")
@click.option("--start-sample", type=click.IntRange(min=0), default=0, show_default=True, help="first global sample")
@click.option("--shuffle", is_flag=True, help="read samples in the trainer's shuffled order (with --seed)")
@click.option("--seed", type=int, default=None, help="seed of the shuffled order  [default: the run's]")
@click.option("--json", "as_json", is_flag=True, help="print {\"loss\": ...} as JSON")
@click.option("--cpu", is_flag=True, help="run on the CPU even when a GPU is visible")
def command(ckpt, data, data_dtype, tp, ep, nproc, seq_len, batch_size, batches, start_sample, shuffle, seed, as_json,
            cpu) -> None:
    """Print the mean token cross-entropy of checkpoint CKPT (or a run directory's newest step) on DATA."""
    try:
        config = EvalConfig(
            checkpoint=ckpt, data=data, data_dtype=data_dtype, tp=tp, ep=ep, seq_len=seq_len, batch_size=batch_size,
            batches=batches, start_sample=start_sample, shuffle=shuffle, seed=seed, cpu=cpu,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if nproc > 1 and not under_torchrun():
        check_launch(config, nproc)
        # Rank 0 of the workers prints {"loss": ...} as its last line of output.
        out = run_torchrun("eval", asdict(config), nproc, capture_stdout=True) or ""
        lines = [line for line in out.splitlines() if line.startswith('{"loss"')]
        if not lines:
            raise LaunchFailedError(f"the {nproc} eval workers reported no loss; their output was: {out[-500:]!r}")
        loss = json.loads(lines[-1])["loss"]
    else:
        loss = evaluate(config)
        if os.environ.get("RANK", "0") != "0":
            return
    batch, seq_len = eval_shape(config, CheckpointReader(ckpt).index.train_state or {})
    tokens = config.batches * batch * seq_len
    click.echo(json.dumps({"loss": loss, "tokens": tokens}) if as_json else
               f"{ckpt}: mean token cross-entropy {loss:.6f} nats over {tokens} tokens "
               f"({config.batches} batches of {batch} x {seq_len}; --batches for more)")
