"""``moeckpt train``: train a bundled MoE model, checkpointing through moeckpt and resuming automatically.

Its options are generated from :class:`moeckpt.trainer.config.TrainConfig` (one option per field, listed by
section), so this module only decides how to run the config: in this process, or under torchrun's agent.
"""

from __future__ import annotations

import signal

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import CheckpointIndexError, NotCommittedError
from moeckpt.trainer.config import TrainConfig
from moeckpt.trainer.launch import (
    Elastic,
    JobInterruptedError,
    run_torchrun,
    under_torchrun,
)
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.models import UnknownModelError

from .config_options import SectionedCommand, config_from_options, config_options


@click.command("train", cls=SectionedCommand)
@config_options(TrainConfig)
def command(**values) -> None:
    """Train MODEL in layout (tp, ep, dp = world / tp), resuming from the newest checkpoint in RUN_DIR.

    World = nproc on one machine; with --nnodes MIN:MAX --rdzv-endpoint HOST:PORT (the same command on every
    node) it is nproc times the nodes alive: a lost node shrinks the world, a new node grows it, and each new
    world resumes from the newest checkpoint, resharded to the layout it can run. With --nproc > 1 a worker
    that fails or hangs makes the workers restart (--max-restarts) from the newest checkpoint.

    Progress (every --log-every steps) goes to stdout; saves, resumes, layout changes, rollbacks and restarts to
    stderr; every step's metrics to RUN_DIR/metrics.jsonl. SIGTERM saves at the next step and exits 0.
    """
    if not values.get("model") and not values.get("init_from"):
        raise click.UsageError("--model is required (a preset or config.json) unless --init-from names a checkpoint")
    config = config_from_options(TrainConfig, values)
    from moeckpt.trainer.data import DataError
    from moeckpt.trainer.train import check_launch, open_dataset, run_model

    try:
        if config.init_from:
            CheckpointReader(config.init_from)
    except (NotCommittedError, CheckpointIndexError) as e:
        raise click.BadParameter(str(e), param_hint="'--init-from'") from None
    try:
        spec = run_model(config)
        spec.require_trainable()  # before any worker starts (each would fail, and be restarted)
    except UnknownModelError as e:
        raise click.BadParameter(str(e), param_hint="'--model'") from None
    name = config.model or spec.arch
    try:
        open_dataset(config, spec)
    except DataError as e:
        raise click.BadParameter(str(e), param_hint="'--data'") from None
    elastic = None
    if config.nnodes is not None or config.rdzv_endpoint is not None:
        elastic = Elastic.parse(
            config.nnodes or "1",
            config.rdzv_endpoint,
            run_id=config.rdzv_id,
            max_restarts=config.max_restarts,
            conf=config.rdzv_conf,
        )
    nproc = config.nproc
    if (elastic is not None or nproc > 1) and not under_torchrun():
        nodes = range(elastic.min_nodes, elastic.max_nodes + 1) if elastic is not None else (1,)
        check_launch(config, nproc, worlds=[nproc * n for n in nodes])  # every world it may shrink or grow to
        result = run_torchrun("train", config.to_json(), nproc, elastic=elastic, max_restarts=config.max_restarts)
        if result.signal == signal.SIGTERM:
            if not result.all_preempted():
                raise JobInterruptedError(
                    f"stopped by SIGTERM, but not every worker reached its save (newest checkpoint in "
                    f"{config.run_dir} is what was committed before)",
                    signal.SIGTERM,
                )
            status = result.rank0() or {}
            saved = "saved" if status.get("steps_trained", 1) else "nothing new to save"
            click.echo(
                f"{name}: stopped by SIGTERM at step {status.get('step')}/{config.steps}, {saved}; checkpoints "
                f"in {config.run_dir}"
            )
            return
        last = result.rank0()
        if last is not None:
            _summary(name, config, last.get("last"), last.get("step"))
            return
        # rank 0 ran on another node: its metrics tell
        records = [r for r in read_metrics(config.run_dir) if "loss" in r]
        _summary(name, config, records[-1] if records else None, records[-1]["step"] if records else None)
        return
    from moeckpt.trainer.preemption import listen_early
    from moeckpt.trainer.train import run_training

    if not under_torchrun():
        check_launch(config, 1)  # the same checks as for N processes, before the model is built
    previous = signal.getsignal(signal.SIGTERM)
    listen_early()  # SIGTERM while the model loads is a preemption notice too: stop before the first step
    try:
        summary = run_training(config)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not _is_rank0():
        return
    last = summary.records[-1] if summary.records else None
    if summary.preempted:
        saved = "saved" if summary.records else "nothing new to save"
        click.echo(
            f"{name}: stopped by SIGTERM at step {summary.step}/{config.steps}, {saved}; checkpoints in "
            f"{config.run_dir}"
        )
        return
    _summary(name, config, last, summary.step)


def _summary(name: str, config: TrainConfig, last: dict | None, step: int | None) -> None:
    """The closing line: where the run got to in this invocation, or why there was nothing to do."""
    if last is not None:
        click.echo(
            f"{name}: step {last['step']}/{config.steps}, loss {last['loss']:.4f}; checkpoints in {config.run_dir}"
        )
        return
    target = config.steps if config.stop_at is None else config.stop_at
    option = "--steps" if config.stop_at is None else "--stop-at"
    click.echo(f"{name}: nothing to do, {config.run_dir} is already at step {step} ({option} {target})")


def _is_rank0() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"
