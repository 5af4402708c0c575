"""``moeckpt train``: train a bundled MoE model, checkpointing through moeckpt and resuming automatically."""

from __future__ import annotations

import click

from moeckpt.trainer.launch import Elastic, run_torchrun, under_torchrun
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.muon_plan import SCHEMES
from moeckpt.trainer.optimizers import OPTIMIZERS
from moeckpt.trainer.train import DTYPES, RESUME_READS, TrainConfig, check_launch, run_model, train

from .common import FormatChoice


class _EpDegree(click.ParamType):
    """A positive integer, or ``auto`` (``None``: chosen per world size)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto":
            return None
        try:
            n = int(value)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            self.fail(f"{value!r} is neither a positive integer nor auto", param, ctx)
        return n


EP_DEGREE = _EpDegree()


@click.command("train")
@click.option("--model", "model", default=None,
              help="preset name (zaya-tiny, qwen3moe-tiny, ...) or a config.json  [required unless --init-from]")
@click.option("--data", default=None, help="token file: .bin (uint16) or .txt (bytes)  [default: the shipped demo text]")
@click.option("--data-dtype", default="auto", show_default=True, help="token dtype of --data: auto, uint16, uint32, bytes")
@click.option("--run-dir", required=True, help="run directory (local path or s3://...): checkpoints and metrics.jsonl")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True, help="tensor-parallel degree")
@click.option("--ep", type=EP_DEGREE, default="1", show_default=True,
              help="expert-parallel degree (divides dp = world / tp), or auto: the widest the model accepts in each "
                   "world (for elastic runs that may shrink below it)")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="local processes (starts torchrun when > 1)")
@click.option("--steps", type=click.IntRange(min=1), default=100, show_default=True,
              help="total steps of the run (a resumed run continues up to it)")
@click.option("--stop-at", type=click.IntRange(min=0), default=None,
              help="stop this invocation after this step (saving first)")
@click.option("--save-every", type=click.IntRange(min=0), default=0, show_default=True,
              help="checkpoint every K steps (0: only at the end)")
@click.option("--format", "fmt", type=FormatChoice(), default="safetensors", show_default=True, help="checkpoint format")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the initial weights and the data order")
@click.option("--global-batch", type=click.IntRange(min=1), default=8, show_default=True, help="samples per step over all ranks")
@click.option("--seq-len", type=click.IntRange(min=1), default=64, show_default=True, help="tokens per sample")
@click.option("--lr", type=float, default=3e-3, show_default=True, help="peak learning rate")
@click.option("--warmup-steps", type=click.IntRange(min=0), default=10, show_default=True, help="linear warmup steps")
@click.option("--weight-decay", type=float, default=0.1, show_default=True,
              help="decoupled weight decay of the matrices (AdamW and Muon)")
@click.option("--max-grad-norm", type=float, default=1.0, show_default=True, help="clip the global gradient norm (0: off)")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="fp32", show_default=True, help="parameter dtype")
@click.option("--sync-save", is_flag=True, help="persist checkpoints in the training thread (default: background)")
@click.option("--keep-last", type=click.IntRange(min=1), default=3, show_default=True, help="checkpoints kept")
@click.option("--cpu", is_flag=True, help="run on the CPU even when a GPU is visible")
@click.option("--inject", multiple=True, metavar="FAULT",
              help="inject a fault (repeatable): kill|hang|nan|kill-during-save|corrupt-file|slow:rank=R,step=S"
                   "[,signal=TERM][,seconds=X]")
@click.option("--hang-timeout", type=click.FloatRange(min=0), default=0, show_default=True,
              help="end a worker whose step makes no progress for this many seconds (0: off)")
@click.option("--max-nan-rollbacks", type=click.IntRange(min=0), default=3, show_default=True,
              help="NaN/Inf loss: roll back to the last checkpoint and skip the batches since, this many times")
@click.option("--nnodes", default=None, metavar="MIN:MAX",
              help="elastic run: this node is one of MIN..MAX nodes (torchrun elastic agent, c10d rendezvous)")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT",
              help="elastic run: the rendezvous, the same on every node; the node on HOST keeps its store")
@click.option("--rdzv-id", default="moeckpt", show_default=True, help="elastic run: the job's rendezvous id")
@click.option("--rdzv-conf", default="", help="elastic run: torchrun --rdzv-conf, e.g. last_call_timeout=5")
@click.option("--init-from", default=None, metavar="CKPT",
              help="start a new run from this checkpoint's weights and optimizer state (e.g. an import-hf output), "
                   "resharded to the run's layout; the run starts at step 0; --model defaults to its model")
@click.option("--resume-reads", type=click.Choice(RESUME_READS), default="auto", show_default=True,
              help="resuming, the ranks exchange replicated pieces over the process group (each stored byte read once), "
                   "read their own, or auto: own on one host with a local checkpoint (the page cache shares the reads), "
                   "else exchange")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True,
              help="adamw, or muon: Muon for the hidden weight matrices, AdamW for the rest, with the same --lr")
@click.option("--muon-momentum", type=float, default=0.95, show_default=True, help="Muon's (Nesterov) momentum")
@click.option("--muon-ns-steps", type=click.IntRange(min=1, max=99), default=5, show_default=True,
              help="Muon's Newton-Schulz iterations")
@click.option("--muon-scheme", type=click.Choice(SCHEMES), default="assign", show_default=True,
              help="where a matrix's pieces meet for Newton-Schulz: assign (one rank each, balanced) or gather "
                   "(every rank holding part of it)")
@click.option("--reset-optimizer", is_flag=True,
              help="resuming from another optimizer's checkpoint: keep its weights and start the optimizer fresh "
                   "(refused otherwise)")
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="elastic run: how often this node's agent restarts its workers (each node loss or join is one)")
def command(model, data, data_dtype, run_dir, tp, ep, nproc, steps, stop_at, save_every, fmt, seed, global_batch, seq_len,
            lr, warmup_steps, weight_decay, max_grad_norm, dtype, sync_save, keep_last, cpu, inject, hang_timeout,
            max_nan_rollbacks, nnodes, rdzv_endpoint, rdzv_id, rdzv_conf, init_from, resume_reads, optimizer,
            muon_momentum, muon_ns_steps, muon_scheme, reset_optimizer, max_restarts) -> None:
    """Train MODEL in layout (tp, ep, dp = world / tp), resuming from the newest checkpoint in RUN_DIR.

    World = nproc on one machine; with --nnodes MIN:MAX --rdzv-endpoint HOST:PORT (the same command on every
    node) it is nproc times the nodes alive: a lost node shrinks the world, a new node grows it, and each new
    world resumes from the newest checkpoint, resharded to the layout it can run.

    Metrics (step, loss, lr, grad_norm, tokens_per_s, save_blocked_s) go to RUN_DIR/metrics.jsonl.
    """
    if not model and not init_from:
        raise click.UsageError("--model is required (a preset or config.json) unless --init-from names a checkpoint")
    try:
        config = TrainConfig(
            model=model or "", data=data, data_dtype=data_dtype, run_dir=run_dir, tp=tp, ep=ep, steps=steps,
            stop_at=stop_at, save_every=save_every, format=fmt, seed=seed, global_batch=global_batch,
            seq_len=seq_len, lr=lr, warmup_steps=warmup_steps, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, dtype=dtype, async_save=not sync_save, keep_last=keep_last, cpu=cpu,
            inject=tuple(inject), hang_timeout_s=hang_timeout, max_nan_rollbacks=max_nan_rollbacks,
            init_from=init_from, resume_reads=resume_reads, optimizer=optimizer, muon_momentum=muon_momentum,
            muon_ns_steps=muon_ns_steps, muon_scheme=muon_scheme, reset_optimizer=reset_optimizer,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    name = model or run_model(config).arch
    elastic = None
    if nnodes is not None or rdzv_endpoint is not None:
        elastic = Elastic.parse(nnodes or "1", rdzv_endpoint, run_id=rdzv_id, max_restarts=max_restarts,
                                conf=rdzv_conf)
    if elastic is not None and not under_torchrun():
        for nodes in range(elastic.min_nodes, elastic.max_nodes + 1):  # every world the job may shrink or grow to
            check_launch(config, nproc * nodes)
        run_torchrun("train", config.to_json(), nproc, elastic=elastic)
        records = read_metrics(run_dir)
    elif nproc > 1 and not under_torchrun():
        check_launch(config, nproc)
        run_torchrun("train", config.to_json(), nproc)
        records = read_metrics(run_dir)
    else:
        records = train(config)
        if not _is_rank0():
            return
    records = [r for r in records if "loss" in r]  # events (a NaN rollback) carry no loss
    if records:
        last = records[-1]
        click.echo(f"{name}: step {last['step']}/{steps}, loss {last['loss']:.4f}; checkpoints in {run_dir}")
    else:
        click.echo(f"{name}: nothing to do, {run_dir} is already at step {steps}")


def _is_rank0() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
