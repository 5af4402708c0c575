"""``moeckpt demo``: the whole story on the embedded default (local disk, CPU), with a summary table and a plot.

1. train zaya-tiny with 4 worker processes (torchrun, gloo) in layout tp=1 ep=2 dp=4, async checkpoints;
2. a worker is killed mid-run (an injected fault): the job dies, the torn state is never committed;
3. resume on 2 workers: the checkpoint is resharded at load (dp 4 -> 2), training continues;
4. grow back to 4 workers (resharded again) and finish;
5. verify, catch a flipped bit, compare layouts with ``diff``, export to Hugging Face and check that transformers
   computes the same logits as our model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import click

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.formats.errors import MoeckptError

TRAIN = ["--model", "zaya-tiny", "--steps", "30", "--save-every", "5", "--global-batch", "8", "--seq-len", "64",
         "--lr", "3e-3", "--warmup-steps", "3", "--seed", "1", "--cpu"]


@dataclass
class Step:
    name: str
    seconds: float
    result: str
    ok: bool


def _moeckpt_subprocess(args: list[str]) -> int:
    """Run a moeckpt command in a fresh process, as a user (or a scheduler) would."""
    click.echo(click.style("$ moeckpt " + " ".join(args), fg="cyan"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "moeckpt.cli.main", *args], env=env, check=False).returncode


def _moeckpt(args: list[str]) -> int:
    """Run a moeckpt command in this process."""
    from .main import cli

    click.echo(click.style("$ moeckpt " + " ".join(args), fg="cyan"))
    try:
        cli.main(args, standalone_mode=False)
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except MoeckptError as e:
        click.echo(f"moeckpt: error: {e}", err=True)
        return e.exit_code


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@click.command("demo")
@click.option("--dir", "workdir", default=None, help="where to keep the demo's files (default: a temporary directory)")
def command(workdir: str | None) -> None:
    """Train a tiny ZAYA on 4 CPU workers, lose one, resume on 2 (resharded), grow back to 4, export to Hugging Face."""
    root = os.path.abspath(workdir or tempfile.mkdtemp(prefix="moeckpt-demo-"))
    os.makedirs(root, exist_ok=True)
    run = os.path.join(root, "run")
    shutil.rmtree(run, ignore_errors=True)
    steps: list[Step] = []
    phases: list[tuple[str, int]] = []  # (label, number of metric rows when the phase ended)

    def step(name: str, fn: Callable[[], tuple[str, bool]]) -> None:
        click.echo(click.style(f"\n== {name}", bold=True))
        t0 = time.perf_counter()
        try:
            result, ok = fn()
        except MoeckptError as e:
            result, ok = f"error: {e}", False
        steps.append(Step(name, time.perf_counter() - t0, result, ok))

    def rows() -> int:
        return len([r for r in _metrics(run) if "loss" in r]) if os.path.exists(os.path.join(run, "metrics.jsonl")) else 0

    def phase1() -> tuple[str, bool]:
        code = _moeckpt_subprocess(["train", *TRAIN, "--run-dir", run, "--nproc", "4", "--ep", "2",
                                    "--inject", "kill:rank=3,step=13"])
        phases.append(("4 workers (tp1 ep2 dp4)", rows()))
        committed = [s for s, _ in committed_steps(run)]
        ok = code != 0 and committed and committed[-1] == 10
        return f"worker 3 killed at step 13 (exit {code}); committed steps {committed}", bool(ok)

    def phase2() -> tuple[str, bool]:
        code = _moeckpt_subprocess(["train", *TRAIN, "--run-dir", run, "--nproc", "2", "--ep", "2", "--stop-at", "20"])
        phases.append(("2 workers, resharded (tp1 ep2 dp2)", rows()))
        reader = CheckpointReader(run)
        return f"resumed step 10 on 2 workers, now at step {reader.index.step} in {reader.index.layout}", code == 0

    def phase3() -> tuple[str, bool]:
        code = _moeckpt_subprocess(["train", *TRAIN, "--run-dir", run, "--nproc", "4", "--ep", "2"])
        phases.append(("4 workers again (tp1 ep2 dp4)", rows()))
        reader = CheckpointReader(run)
        last = [r for r in _metrics(run) if "loss" in r][-1]
        return f"step {reader.index.step}, loss {last['loss']:.3f}, layout {reader.index.layout}", code == 0 and reader.index.step == 30

    step("train on 4 workers; a worker dies at step 13", phase1)
    step("resume on 2 workers (resharded at load)", phase2)
    step("grow back to 4 workers (resharded again)", phase3)
    step("verify every checksum of the last checkpoint", lambda: _expect(_moeckpt(["verify", run]), 0))

    single = os.path.join(root, "ckpt-1x1x1")
    step("reshard offline to one process (tp1 ep1 dp1)",
         lambda: _expect(_moeckpt(["reshard", run, single, "--tp", "1", "--ep", "1", "--dp", "1", "--overwrite"]), 0))
    step("diff across layouts (identical)", lambda: _expect(_moeckpt(["diff", run, single]), 0))

    def corrupt() -> tuple[str, bool]:
        bad = os.path.join(root, "ckpt-corrupt")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(single, bad)
        path = os.path.join(bad, "rank-00000.safetensors")
        with open(path, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
        return _expect(_moeckpt(["verify", bad]), 1)

    step("flip one bit: verify fails naming file and tensor", corrupt)
    hf = os.path.join(root, "hf")
    step("export to Hugging Face", lambda: _expect(_moeckpt(["export-hf", run, hf, "--overwrite"]), 0))
    step("transformers loads it and computes our logits", lambda: _check_transformers(run, hf))
    png = os.path.join(root, "loss.png")
    step("loss curve across the failure and both layout changes", lambda: _plot(run, phases, png))

    click.echo("")
    click.echo(click.style("moeckpt demo summary", bold=True) + f"  (files in {root})")
    width = max(len(s.name) for s in steps)
    for s in steps:
        mark = click.style("ok  ", fg="green") if s.ok else click.style("FAIL", fg="red")
        click.echo(f"  {mark} {s.name:<{width}}  {s.seconds:6.1f}s  {s.result}")
    if not all(s.ok for s in steps):
        raise SystemExit(1)


def _expect(code: int, want: int) -> tuple[str, bool]:
    return f"exit {code}", code == want


def _check_transformers(run: str, hf_dir: str) -> tuple[str, bool]:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        return "skipped: transformers is not installed (pip install 'moeckpt[hf]')", True
    import torch

    from moeckpt.trainer.models import ModelSpec
    from moeckpt.trainer.models.layers import build_model

    reader = CheckpointReader(run)
    spec = ModelSpec.from_json(reader.index.model)
    ours = build_model(spec)
    params = {n: reader.read_tensor(n) for n, e in reader.index.tensors.items() if e.role == "param"}
    ours.load_state_dict(params, strict=True)
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = torch.randint(0, spec.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((ours(ids) - theirs(input_ids=ids).logits).abs().max())
    return f"max |logits difference| = {diff:.2e}", diff < 1e-4


def _plot(run: str, phases: list[tuple[str, int]], path: str) -> tuple[str, bool]:
    rows = [r for r in _metrics(run) if "loss" in r]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed", True
    fig, ax = plt.subplots(figsize=(8, 4))
    start = 0
    for label, end in phases:
        part = rows[start:end]
        ax.plot([r["step"] for r in part], [r["loss"] for r in part], marker=".", label=label)
        start = end
    ax.axvline(13, color="red", linestyle=":", label="worker killed (step 13)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (zaya-tiny)")
    ax.set_title("moeckpt demo: lose a worker, resume resharded on 2, grow back to 4")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path, True
