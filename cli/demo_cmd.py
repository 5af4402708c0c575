"""``moeckpt demo``: the whole story on the embedded default (local disk, CPU), with a summary table and a plot.

1. train zaya-tiny on two nodes of 2 worker processes each: two ``moeckpt train --nnodes 1:2`` torchrun elastic
   agents meeting at a c10d rendezvous on 127.0.0.1, gloo, layout tp=1 ep=2 dp=4, async checkpoints;
2. node B is killed outright at step 17 (agent and workers, as a lost machine); node A's agent re-forms the
   world alone and its 2 workers resume from step 15, resharded at load (dp 4 -> 2);
3. node C joins: the job grows back to 4 workers (resharded again) and finishes;
4. verify, catch a flipped bit, compare layouts with ``diff``, export to Hugging Face and check that transformers
   computes the same logits as our model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import click

from moeckpt.formats.errors import MoeckptError
from moeckpt.trainer.elastic_drill import (
    CPU_DRILL_KILL_AT as KILL_AT,
)
from moeckpt.trainer.elastic_drill import (
    CPU_DRILL_STEPS as STEPS,
)
from moeckpt.trainer.elastic_drill import (
    DrillResult,
    cpu_drill_args,
    plot_drill,
    run_shrink_grow_drill,
)
from moeckpt.trainer.hf_check import logits_difference

from .params import Text

#: what the demo's logits check and loss curve import: the ``demo`` extra (pyproject.toml).
DEMO_EXTRA_MODULES = ("transformers", "matplotlib")
#: the file in the demo's directory that holds the elastic drill's records, timeline and exit codes.
DRILL_JSON = "drill.json"


@dataclass
class Step:
    name: str
    seconds: float
    result: str
    ok: bool


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


@click.command("demo")
@click.option(
    "--dir",
    "workdir",
    type=Text(),
    default=None,
    metavar="DIR",
    help="where the demo keeps its files (run directory, checkpoints, HF export, loss.png); kept "
    "afterwards  [default: a new moeckpt-demo-* directory in the temporary directory]",
)
@click.option(
    "--memory-tier/--no-memory-tier",
    default=True,
    show_default=True,
    help="run the drill with the in-memory checkpoint tier (a memory checkpoint every step, each node its "
    "own memory directory, node B's deleted with it): the survivors resume from memory; without it "
    "they resume from the last persisted checkpoint",
)
def command(workdir: str | None, memory_tier: bool) -> None:
    """The whole story on this machine, about a minute on 2 CPU cores: zaya-tiny trains on two local nodes of 2
    workers each (two torchrun elastic agents, gloo); one node is lost at step 17 and the survivor resumes on 2
    workers (resharded dp 4 -> 2); a new node joins and the job grows back to 4 (resharded again). Then it
    verifies, reshards offline, diffs across layouts, catches a flipped bit, exports to Hugging Face, checks that
    transformers computes the same logits, and draws the loss curve (loss.png). Exit 0 when every step is ok."""
    missing = [m for m in DEMO_EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise click.UsageError(
            f"moeckpt demo needs the demo extra ({', '.join(missing)} not installed): pip install 'moeckpt[demo]'"
        )
    root = os.path.abspath(workdir or tempfile.mkdtemp(prefix="moeckpt-demo-"))
    os.makedirs(root, exist_ok=True)
    click.echo(f"moeckpt demo: working in {root} (kept afterwards; --dir chooses it)")
    run = os.path.join(root, "run")
    shutil.rmtree(run, ignore_errors=True)
    steps: list[Step] = []

    def step(name: str, fn: Callable[[], tuple[str, bool]]) -> None:
        click.echo(click.style(f"\n== {name}", bold=True))
        t0 = time.perf_counter()
        try:
            result, ok = fn()
        except MoeckptError as e:
            result, ok = f"error: {e}", False
        steps.append(Step(name, time.perf_counter() - t0, result, ok))

    drills: list[DrillResult] = []

    def elastic_run() -> tuple[str, bool]:
        memory = os.path.join(root, "memory") if memory_tier else None
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)
        result = run_shrink_grow_drill(
            run,
            cpu_drill_args(run),
            nproc=2,
            kill_at_step=KILL_AT,
            timeout_s=600,
            progress=click.echo,
            memory_root=memory,
        )
        drills.append(result)
        with open(os.path.join(root, DRILL_JSON), "w") as f:  # what the drill saw, for tests and plots
            json.dump(result.to_json(), f)
        resumes = [e for e in result.events() if e.get("event") == "resume"]
        worlds = result.worlds()
        last = result.steps()[-1] if result.steps() else {}
        ok = (
            result.exit_codes == {"A": 0, "C": 0}
            and [w for _, w in worlds] == [4, 2, 4]
            and last.get("step") == STEPS
            and len(resumes) == 2
        )
        story = "; ".join(
            f"{w} workers from step {s}"
            + (f" (resumed step {r['step']}, dp {r['from_layout']['dp']}->{r['to_layout']['dp']})" if r else "")
            for (s, w), r in zip(worlds, [None, *resumes])
        )
        shrink = result.shrink_resume()
        if shrink is not None:
            click.echo(
                f"node B lost at step {result.kill_step()}: the survivors resumed from the "
                f"{shrink.get('tier') or 'storage'} tier at step {shrink['step']}, {result.steps_lost()} "
                f"step(s) lost, {shrink.get('storage_bytes_read', shrink['bytes_read']) / 1e6:.2f} MB read "
                "from storage"
            )
        return f"{story}; step {last.get('step')}, loss {last.get('loss', float('nan')):.3f}", ok

    step(f"2 nodes x 2 workers (elastic agents); node B dies at step {KILL_AT}; node C joins later", elastic_run)
    step("verify every checksum of the last checkpoint", lambda: _expect(_moeckpt(["verify", run]), 0))

    single = os.path.join(root, "ckpt-1x1x1")
    step(
        "reshard offline to one process (tp1 ep1 dp1)",
        lambda: _expect(_moeckpt(["reshard", run, single, "--tp", "1", "--ep", "1", "--dp", "1", "--overwrite"]), 0),
    )
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
    step("loss curve across the failure and both layout changes", lambda: _plot(drills, png))

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
    diff = logits_difference(run, hf_dir)
    return f"max |logits difference| = {diff:.2e}", diff < 1e-4


def _plot(drills: list[DrillResult], path: str) -> tuple[str, bool]:
    if not drills:
        return "no run to plot", False
    plot_drill(drills[0], path, title=f"moeckpt demo: node lost at step {KILL_AT}, resumed on 2 workers, grown to 4")
    return path, True
