"""``moeckpt demo``: the whole story on the embedded default (local disk, CPU), with a summary table."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import click

from moeckpt.formats.checkpoint import CheckpointReader, begin_save, verify
from moeckpt.formats.errors import MoeckptError, NotCommittedError


@dataclass
class Step:
    name: str
    seconds: float
    result: str
    ok: bool


def _run(cli_args: list[str]) -> int:
    """Run one moeckpt subcommand in-process, as a user would type it."""
    from .main import cli

    click.echo(click.style("$ moeckpt " + " ".join(cli_args), fg="cyan"))
    try:
        cli.main(cli_args, standalone_mode=False)
        return 0
    except SystemExit as e:
        return int(e.code or 0)
    except MoeckptError as e:
        click.echo(f"moeckpt: error: {e}", err=True)
        return e.exit_code


@click.command("demo")
@click.option("--dir", "workdir", default=None, help="where to keep the demo's files (default: a temporary directory)")
@click.option("--model", "model_name", default="zaya-tiny", show_default=True)
def command(workdir: str | None, model_name: str) -> None:
    """Walk through the toolkit on a tiny ZAYA model: save, verify, compare across layouts, survive corruption."""
    root = workdir or tempfile.mkdtemp(prefix="moeckpt-demo-")
    os.makedirs(root, exist_ok=True)
    steps: list[Step] = []

    def step(name: str, fn: Callable[[], tuple[str, bool]]) -> None:
        t0 = time.perf_counter()
        result, ok = fn()
        steps.append(Step(name, time.perf_counter() - t0, result, ok))

    a = os.path.join(root, "ckpt-tp2-ep2-dp2")
    b = os.path.join(root, "ckpt-tp1-ep1-dp1")
    bad = os.path.join(root, "ckpt-corrupt")
    common = ["--model", model_name, "--with-optimizer", "--dtype", "bf16", "--seed", "1", "--overwrite"]

    step("save in layout tp=2 ep=2 dp=2", lambda: _expect(_run(["init", a, "--tp", "2", "--ep", "2", "--dp", "2", *common]), 0))
    step("inspect", lambda: _expect(_run(["inspect", a]), 0))
    step("verify every checksum", lambda: _expect(_run(["verify", a]), 0))
    step("save the same seed in layout tp=1 ep=1 dp=1", lambda: _expect(_run(["init", b, *common]), 0))
    step("diff across layouts (identical)", lambda: _expect(_run(["diff", a, b]), 0))

    def corrupt() -> tuple[str, bool]:
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(a, bad)
        path = os.path.join(bad, "rank-00001.safetensors")
        with open(path, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x10]))
        return _expect(_run(["verify", bad]), 1)

    step("flip one bit: verify fails naming file and tensor", corrupt)

    def torn_save() -> tuple[str, bool]:
        target = os.path.join(root, "ckpt-torn")
        shutil.rmtree(target, ignore_errors=True)
        staging = begin_save(target)
        staging.write_bytes("rank-00000.safetensors", b"half a file")  # the process "dies" here
        try:
            CheckpointReader(target)
        except NotCommittedError:
            return "reader ignores the uncommitted save", True
        return "a torn save looked committed", False

    step("process killed mid-save: nothing committed", torn_save)
    reader = CheckpointReader(a)
    problems = verify(reader)
    steps.append(Step("final check of the good checkpoint", 0.0, "sound" if not problems else problems[0], not problems))

    click.echo("")
    click.echo(click.style("moeckpt demo summary", bold=True) + f"  (files in {root})")
    width = max(len(s.name) for s in steps)
    for s in steps:
        mark = click.style("ok  ", fg="green") if s.ok else click.style("FAIL", fg="red")
        click.echo(f"  {mark} {s.name:<{width}}  {s.seconds:6.2f}s  {s.result}")
    if not all(s.ok for s in steps):
        raise SystemExit(1)


def _expect(code: int, want: int) -> tuple[str, bool]:
    return f"exit {code}", code == want
