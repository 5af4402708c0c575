"""``moeckpt eval``: the loss of a checkpoint equals the loss the trainer computed on the same batch."""

from __future__ import annotations

import json

import pytest

from moeckpt.trainer.data import default_text_path
from moeckpt.trainer.evaluate import EvalConfig, evaluate
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.train import TrainConfig, train

from ..train_workers import eval_run

BATCH = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three steps of zaya-tiny with a checkpoint after step 2: step 3's logged loss is the loss of that
    checkpoint's weights on global samples 2B .. 3B-1 of the seed's order."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    train(
        TrainConfig(
            model="zaya-tiny",
            run_dir=str(run_dir),
            steps=3,
            save_every=2,
            seq_len=32,
            global_batch=BATCH,
            seed=7,
            cpu=True,
            async_save=False,
        )
    )
    loss = {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}[3]
    return run_dir, loss


def _step2_config(run_dir, **kw) -> EvalConfig:
    return EvalConfig(
        checkpoint=str(run_dir / "step-00000002"),
        data=default_text_path(),
        start_sample=2 * BATCH,
        batches=1,
        shuffle=True,
        **kw,
    )


def test_eval_equals_the_trainers_loss_on_the_same_batch(run):
    run_dir, trained = run
    # seq_len, batch size and seed default to the run's, read from the checkpoint's train state.
    assert evaluate(_step2_config(run_dir)) == pytest.approx(trained, abs=1e-6)


def test_eval_cli_and_another_layout(run, moeckpt_cli, tmp_path):
    run_dir, trained = run
    code, out, err = moeckpt_cli(
        "eval",
        run_dir / "step-00000002",
        "--data",
        default_text_path(),
        "--start-sample",
        2 * BATCH,
        "--batches",
        1,
        "--shuffle",
        "--json",
    )
    assert code == 0, err
    assert json.loads(out)["loss"] == pytest.approx(trained, abs=1e-6)
    assert json.loads(out)["tokens"] == 1 * BATCH * 32  # the checkpoint's global batch and seq_len
    # Two ranks, tp=2: the checkpoint (written by one process) is resharded at load.
    out_file = tmp_path / "loss.json"
    cfg = _step2_config(run_dir, tp=2).__dict__
    run_local_world(eval_run, 2, cfg, str(out_file), timeout_s=120)
    assert json.loads(out_file.read_text())["loss"] == pytest.approx(trained, abs=1e-5)
    # The run directory means its newest step; plain file order by default.
    code, out, err = moeckpt_cli("eval", run_dir, "--data", default_text_path(), "--batches", 2)
    assert code == 0, err
    assert "mean token cross-entropy" in out and f"over {2 * BATCH * 32} tokens" in out


def test_eval_bad_input(moeckpt_cli, tmp_path, run):
    code, _, err = moeckpt_cli("eval", tmp_path / "nothing", "--data", default_text_path())
    assert code == 2 and "moeckpt: error" in err
    code, _, err = moeckpt_cli("eval", run[0], "--data", tmp_path / "missing.txt")
    assert code == 2 and "missing.txt" in err
    # Checked before torchrun would start any worker.
    code, _, err = moeckpt_cli("eval", run[0], "--data", default_text_path(), "--nproc", 3, "--tp", 3)
    assert code == 2 and "tp=3" in err
