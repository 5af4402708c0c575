"""Automatic resume in one process: over S3 (moto) bit for bit, and refusals of a run directory of another model."""

from __future__ import annotations

import pytest

from moeckpt.formats.checkpoint import committed_steps
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.resume import ResumeError
from moeckpt.trainer.train import TrainConfig, train

BASE = {"model": "zaya-tiny", "steps": 6, "seq_len": 32, "global_batch": 4, "warmup_steps": 2, "cpu": True}


def test_resume_from_s3_is_bit_exact(tmp_path, s3_url):
    straight = train(TrainConfig(run_dir=str(tmp_path / "local"), **BASE))
    first = train(TrainConfig(run_dir=s3_url, stop_at=3, **BASE))  # async save to S3, then "interrupted"
    second = train(TrainConfig(run_dir=s3_url, **BASE))
    assert [r["step"] for r in first + second] == list(range(1, 7))
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    assert [s for s, _ in committed_steps(s3_url)] == [3, 6]
    assert [r["step"] for r in read_metrics(s3_url)] == list(range(1, 7))  # rewritten whole on object stores


def test_resume_refuses_another_model(tmp_path):
    run_dir = str(tmp_path / "run")
    train(TrainConfig(run_dir=run_dir, **{**BASE, "steps": 1}))
    with pytest.raises(ResumeError, match="another config"):
        train(TrainConfig(run_dir=run_dir, **{**BASE, "model": "qwen3moe-tiny"}))


def test_should_stop_saves_and_returns_early(tmp_path):
    from moeckpt.trainer.train import Trainer

    run_dir = str(tmp_path / "run")
    trainer = Trainer(TrainConfig(run_dir=run_dir, **BASE))
    try:
        records = trainer.run(should_stop=lambda: trainer.step >= 2)
    finally:
        trainer.close()
    assert [r["step"] for r in records] == [1, 2]
    assert [s for s, _ in committed_steps(run_dir)] == [2]


def test_metrics_reader_leaves_out_a_line_still_being_written(tmp_path):
    from moeckpt.trainer.metrics import METRICS_FILE

    (tmp_path / METRICS_FILE).write_text('{"step":1,"loss":2.0}\n{"event":"resume","step":1}\n{"step":2,"lo')
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 2.0}]
    assert [r.get("event") for r in read_metrics(str(tmp_path), events=True)] == [None, "resume"]
