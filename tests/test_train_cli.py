"""``moeckpt train`` through the real command line: torchrun with two workers, then a resume in one process."""

from __future__ import annotations

import os
import subprocess
import sys

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.trainer.metrics import read_metrics

ARGS = ["--model", "zaya-tiny", "--steps", "6", "--seq-len", "32", "--global-batch", "4", "--cpu"]


def test_train_nproc2_then_resume_in_another_layout(tmp_path, moeckpt_cli):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moeckpt.cli.main", "train", *ARGS, "--run-dir", str(run_dir), "--nproc", "2",
         "--ep", "2", "--stop-at", "4", "--save-every", "2", "--format", "zarr"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4/6" in proc.stdout
    assert [s for s, _ in committed_steps(str(run_dir))] == [2, 4]
    index = CheckpointReader(str(run_dir)).index
    assert index.layout == {"tp": 1, "ep": 2, "dp": 2} and index.backend == "zarr"
    assert index.train_state["step"] == 4 and index.train_state["consumed_samples"] == 16
    # Same command, one process: resumes at step 4 from the (1,2,2) checkpoint and finishes the run.
    code, out, err = moeckpt_cli("train", *ARGS, "--run-dir", run_dir, "--format", "zarr")
    assert code == 0, err
    assert "step 6/6" in out
    steps = [r["step"] for r in read_metrics(str(run_dir))]
    assert steps == [1, 2, 3, 4, 5, 6]
    code, out, _ = moeckpt_cli("train", *ARGS, "--run-dir", run_dir)
    assert code == 0 and "already at step 6" in out


def test_train_bad_input(tmp_path, moeckpt_cli):
    code, _, err = moeckpt_cli("train", "--model", "no-such-model", "--run-dir", tmp_path / "r")
    assert code == 2 and "no-such-model" in err
    code, _, err = moeckpt_cli("train", *ARGS, "--run-dir", tmp_path / "r", "--tp", "3", "--nproc", "3")
    assert code == 2 and "tp=3" in err
    code, _, err = moeckpt_cli("train", *ARGS, "--run-dir", tmp_path / "r", "--nproc", "8")
    assert code == 2 and "global_batch=4" in err
    code, _, err = moeckpt_cli("train", *ARGS, "--run-dir", tmp_path / "r", "--stop-at", "9")
    assert code == 2 and "stop_at" in err
