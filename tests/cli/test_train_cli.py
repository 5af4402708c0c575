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
        [
            sys.executable,
            "-m",
            "moeckpt.cli.main",
            "train",
            *ARGS,
            "--run-dir",
            str(run_dir),
            "--nproc",
            "2",
            "--ep",
            "2",
            "--stop-at",
            "4",
            "--save-every",
            "2",
            "--format",
            "zarr",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
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


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(run_dir)) if "loss" in r]


def test_fine_tune_an_imported_checkpoint_with_init_from(tmp_path, moeckpt_cli):
    """import-hf, then `train --init-from`: the run starts from the imported weights, resharded, at step 0."""
    code, _, err = moeckpt_cli("init", tmp_path / "base", "--model", "zaya-tiny", "--seed", 3, "--ep", 2, "--dp", 2)
    assert code == 0, err
    assert moeckpt_cli("export-hf", tmp_path / "base", tmp_path / "hf")[0] == 0
    code, _, err = moeckpt_cli("import-hf", tmp_path / "hf", tmp_path / "imported")
    assert code == 0, err
    common = ("--steps", 2, "--save-every", 2, "--warmup-steps", 1)
    # the imported checkpoint itself is not a run directory: refused, nothing written into it
    code, _, err = moeckpt_cli("train", "--model", "zaya-tiny", "--run-dir", tmp_path / "imported", *common)
    assert code == 2 and "--init-from" in err and len(err.strip().splitlines()) == 1
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path / "imported"))

    code, out, err = moeckpt_cli("train", "--init-from", tmp_path / "imported", "--run-dir", tmp_path / "ft", *common)
    assert code == 0, err
    assert out.startswith("zaya: step 2/2")  # --model defaults to the checkpoint's
    events = [r for r in read_metrics(str(tmp_path / "ft"), events=True) if r.get("event") == "init_from"]
    assert len(events) == 1 and events[0]["checkpoint_step"] == 0
    # the same weights from the original checkpoint in another layout give the same losses; random weights do not
    code, _, err = moeckpt_cli("train", "--init-from", tmp_path / "base", "--run-dir", tmp_path / "ft2", *common)
    assert code == 0, err
    code, _, err = moeckpt_cli("train", "--model", "zaya-tiny", "--run-dir", tmp_path / "fresh", *common)
    assert code == 0, err
    imported, base, fresh = _losses(tmp_path / "ft"), _losses(tmp_path / "ft2"), _losses(tmp_path / "fresh")
    assert len(imported) == 2 and max(abs(a - b) for a, b in zip(imported, base)) < 1e-5
    assert abs(imported[0] - fresh[0]) > 1e-3
    index = CheckpointReader(str(tmp_path / "ft" / "step-00000002")).index
    assert index.train_state["step"] == 2 and index.train_state["consumed_samples"] == 16
    # once the run has a checkpoint, --init-from is ignored: the run resumes from its own
    code, _, err = moeckpt_cli(
        "train", "--init-from", tmp_path / "imported", "--run-dir", tmp_path / "ft", "--steps", 3, "--warmup-steps", 1
    )
    assert code == 0 and "resumed" in err and "step-00000002" in err, err
