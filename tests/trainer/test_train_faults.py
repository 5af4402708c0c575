"""Failure handling in the training loop: NaN rollback, SIGTERM, the hang watchdog, a kill during save."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moeckpt.formats.checkpoint import committed_steps
from moeckpt.trainer.train import NonFiniteLossError, TrainConfig, train
from moeckpt.trainer.watchdog import HANG_EXIT_CODE

pytestmark = pytest.mark.slow  # multi-process

TINY = {"model": "zaya-tiny", "global_batch": 4, "seq_len": 16, "warmup_steps": 2, "seed": 3}


def _metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_nan_loss_rolls_back_and_skips_the_bad_window(tmp_path):
    run = str(tmp_path / "run")
    records = train(TrainConfig(run_dir=run, steps=10, save_every=4, inject=("nan:step=6",), **TINY))
    rows = _metrics(run)
    events = [r for r in rows if r.get("event") == "nan_rollback"]
    assert len(events) == 1 and events[0]["step"] == 4  # back to the checkpoint of step 4
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]  # step 5 trained twice: before the NaN and after rollback
    assert all(r["loss"] == r["loss"] for r in records)  # no NaN was ever recorded as a loss
    # the window was skipped: after the rollback the data position kept going instead of replaying samples
    assert events[0]["consumed_samples"] == 6 * 4


def test_nan_rollbacks_are_bounded(tmp_path):
    run = str(tmp_path / "run")
    cfg = TrainConfig(
        run_dir=run, steps=10, save_every=2, max_nan_rollbacks=1, inject=("nan:step=3", "nan:step=4"), **TINY
    )
    with pytest.raises(NonFiniteLossError, match="1 rollbacks did not help"):
        train(cfg)


def test_nan_without_checkpoint_stops_with_a_report(tmp_path):
    with pytest.raises(NonFiniteLossError, match="no checkpoint to roll back to"):
        train(TrainConfig(run_dir=str(tmp_path / "run"), steps=6, inject=("nan:step=2",), **TINY))


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moeckpt.cli.main", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sigterm_saves_at_the_next_step_and_exits_zero(tmp_path):
    run = str(tmp_path / "run")
    r = _cli(
        "train",
        "--model",
        "zaya-tiny",
        "--run-dir",
        run,
        "--steps",
        "20",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--inject",
        "kill:rank=0,step=4,signal=TERM",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert [s for s, _ in committed_steps(run)] == [4]
    assert [m["step"] for m in _metrics(run)][-1] == 4
    # and the next invocation continues from there
    r = _cli(
        "train", "--model", "zaya-tiny", "--run-dir", run, "--steps", "6", "--global-batch", "4", "--seq-len", "16"
    )
    assert r.returncode == 0 and "step 6/6" in r.stdout


def test_watchdog_ends_a_hung_step_with_a_report(tmp_path):
    run = str(tmp_path / "run")
    r = _cli(
        "train",
        "--model",
        "zaya-tiny",
        "--run-dir",
        run,
        "--steps",
        "20",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--inject",
        "hang:rank=0,step=3",
        "--hang-timeout",
        "3",
    )
    assert r.returncode == HANG_EXIT_CODE, r.stderr[-2000:]
    assert "no progress" in r.stderr and "after step 2" in r.stderr
    report = open(os.path.join(run, "hang-rank0.txt")).read()
    assert "before_step" in report  # the stack says where it hung


def test_a_damaged_checkpoint_is_set_aside_and_resume_takes_the_previous_one(tmp_path):
    run = str(tmp_path / "run")
    common = (
        "train",
        "--model",
        "zaya-tiny",
        "--run-dir",
        run,
        "--steps",
        "12",
        "--save-every",
        "4",
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--nproc",
        "2",
        "--cpu",
    )
    # rank 1's file of step 8 gets a flipped byte after the commit; the job then dies at step 10 (saves are
    # synchronous here, so step 8 is surely committed by then), for good: no automatic restart
    r = _cli(
        *common,
        "--sync-save",
        "--inject",
        "corrupt-file:rank=1,step=8",
        "--inject",
        "kill:rank=0,step=10",
        "--max-restarts",
        "0",
        timeout=240,
    )
    assert r.returncode != 0
    assert [s for s, _ in committed_steps(run)] == [4, 8]
    before = {m["step"]: m["loss"] for m in _metrics(run) if "loss" in m}

    r = _cli(*common, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint of step 8 is damaged" in r.stderr
    rows = _metrics(run)
    damaged = [m for m in rows if m.get("event") == "damaged_checkpoint"]
    assert len(damaged) == 1 and damaged[0]["step"] == 8 and "rank-00001.safetensors" in damaged[0]["error"]
    assert os.path.isdir(damaged[0]["moved_to"]) and os.path.basename(damaged[0]["moved_to"]).startswith(
        "damaged-step-00000008-"
    )
    resumes = [m for m in rows if m.get("event") == "resume"]
    assert resumes[-1]["step"] == 4  # the previous checkpoint
    # steps 5-9 trained again from the same weights and samples in the same layout: the same losses, bit for bit
    again = [m for m in rows[rows.index(resumes[-1]) :] if "loss" in m]
    assert [m["step"] for m in again] == list(range(5, 13))
    assert all(m["loss"] == before[m["step"]] for m in again if m["step"] in before), (again, before)
    assert [s for s, _ in committed_steps(run)][-1] == 12  # step 8 saved afresh where the damaged one was
