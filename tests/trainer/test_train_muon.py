"""The trainer under ``--optimizer muon``: bit-exact resume in the same layout, the weights after a resume equal
those saved, resume in other layouts and world sizes within tolerance, the checkpoint tools on a Muon checkpoint,
and the refusal to continue another optimizer's state unless ``--reset-optimizer``."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.trainer.elastic_drill import CPU_DRILL_KILL_AT, CPU_DRILL_STEPS, cpu_drill_args, run_shrink_grow_drill
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.optimizer_choice import OptimizerMismatchError
from moeckpt.trainer.train import TrainConfig, Trainer, train

from ..helpers import check_shrink_and_grow
from ..muon_workers import train_runs, weights_survive_resume

STEPS = 8
BASE = {
    "model": "zaya-tiny",
    "steps": STEPS,
    "seq_len": 32,
    "global_batch": 8,
    "warmup_steps": 2,
    "cpu": True,
    "optimizer": "muon",
}
#: cross-layout tolerance on the loss after 8 steps (layouts differ by reduction order; bf16 Newton-Schulz may round
#: an element the other way, which the next steps carry on).
ATOL = 2e-4


def _config(run_dir, **kw) -> dict:
    return TrainConfig(run_dir=str(run_dir), **{**BASE, **kw}).to_json()


def _losses(run_dir) -> list[float]:
    by_step = {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}  # the last record of a step wins
    return [by_step[s] for s in sorted(by_step)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Layout (1,1,1) in this process, a checkpoint at step 4."""
    root = tmp_path_factory.mktemp("muon-reference")
    train(TrainConfig.from_json(_config(root / "run", save_every=4, async_save=False)))
    losses = _losses(root / "run")
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return {"losses": losses, "root": root}


def test_ep2_dp2_resumes_bit_exactly_and_continues_in_one_process(reference, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_local_world(
        train_runs,
        2,
        [_config(straight, ep=2), _config(split, ep=2, stop_at=4), _config(split, ep=2, save_every=2)],
        timeout_s=400,
    )
    losses = _losses(straight)
    assert _losses(split) == losses  # steps 1-8 == 1-4 + resume + 5-8, bit for bit
    assert losses == pytest.approx(reference["losses"], abs=ATOL)
    index = CheckpointReader(str(split)).index
    recorded = index.train_state["optimizer"]
    assert recorded["name"] == "muon" and recorded["steps"] == STEPS
    assert recorded["hyperparameters"]["momentum"] == 0.95 and recorded["hyperparameters"]["ns_steps"] == 5
    assert recorded["hyperparameters"]["adamw"]["weight_decay"] == 0.1
    roles = {e.role for e in index.tensors.values()}
    assert roles == {"param", "momentum", "exp_avg", "exp_avg_sq"}

    # the (1,2,2) checkpoint of step 4 continues in one process (ZeRO parts joined, experts gathered)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copytree(split / "step-00000004", moved / "step-00000004")
    records = train(TrainConfig.from_json(_config(moved, async_save=False)))
    assert [r["step"] for r in records] == list(range(5, STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx(reference["losses"][4:], abs=ATOL)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_weights_after_a_resume_are_the_weights_saved(tmp_path, dtype):
    """Every tensor a rank holds after the resume (parameters, fp32 masters, momentum, AdamW moments) is bit for
    bit what it held at the save: the resume cannot continue from other weights (Megatron-LM PR #6920)."""
    weights_survive_resume(0, _config(tmp_path / "one", stop_at=3, dtype=dtype, async_save=False))
    run_local_world(weights_survive_resume, 2, _config(tmp_path / "two", stop_at=3, dtype=dtype, ep=2), timeout_s=300)


def test_a_single_process_checkpoint_continues_in_tp2_ep2_dp2(reference, tmp_path):
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(reference["root"] / "run" / "step-00000004", resumed / "step-00000004")
    run_local_world(train_runs, 4, [_config(resumed, tp=2, ep=2, muon_scheme="gather")], timeout_s=400)
    assert _losses(resumed) == pytest.approx(reference["losses"][4:], abs=ATOL)


@pytest.mark.slow
def test_tp2_dp4_matches_single_process(reference, tmp_path):
    run_local_world(train_runs, 8, [_config(tmp_path / "run", tp=2, ep=1)], timeout_s=500)
    assert _losses(tmp_path / "run") == pytest.approx(reference["losses"], abs=ATOL)


def test_shrink_and_grow_as_resumes_in_other_world_sizes(reference, tmp_path):
    """What an elastic job does (test_elastic_drill_under_muon runs the real agents): 4 workers to step 3,
    2 after losing half of them to step 6, 4 again to the end; each world resumes the previous one's checkpoint."""
    run = tmp_path / "run"
    run_local_world(train_runs, 4, [_config(run, ep=2, stop_at=3)], timeout_s=300)
    run_local_world(train_runs, 2, [_config(run, ep=2, stop_at=6)], timeout_s=300)
    run_local_world(train_runs, 4, [_config(run, ep=2)], timeout_s=300)
    resumes = [r for r in read_metrics(str(run), events=True) if r.get("event") == "resume"]
    assert [(r["from_layout"]["dp"], r["to_layout"]["dp"]) for r in resumes] == [(4, 2), (2, 4)]
    assert _losses(run) == pytest.approx(reference["losses"], abs=ATOL)


def test_another_optimizers_state_is_refused_unless_reset(tmp_path):
    run = str(tmp_path / "run")
    common = {**BASE, "steps": 4, "async_save": False}
    train(TrainConfig(run_dir=run, **{**common, "optimizer": "adamw", "stop_at": 2}))
    with pytest.raises(OptimizerMismatchError, match="written by adamw, this run uses muon.*--reset-optimizer"):
        train(TrainConfig(run_dir=run, **common))
    saved = CheckpointReader(run)
    params = {n: saved.read_tensor(n) for n, e in saved.index.tensors.items() if e.role == "param"}
    trainer = Trainer(TrainConfig(run_dir=run, **common, reset_optimizer=True))
    try:
        assert trainer.step == 2 and trainer.optimizer.name == "muon" and trainer.optimizer.steps == 0
        for piece in trainer.optimizer.param_pieces():
            assert torch.equal(piece.tensor, params[piece.param][piece.box.slices()]), piece.name
        assert all(not p.tensor.any() for p in trainer.optimizer.pieces())  # fresh moments and momentum
        trainer.run()
    finally:
        trainer.close()
    assert CheckpointReader(run).index.train_state["optimizer"]["name"] == "muon"
    events = [r for r in read_metrics(run, events=True) if r.get("event") == "resume"]
    assert [e["optimizer_reset"] for e in events] == [True]
    # the run's own Muon state now loads as it is, --reset-optimizer or not (an elastic restart keeps it)
    again = Trainer(TrainConfig(run_dir=run, **{**common, "steps": 5}, reset_optimizer=True))
    try:
        assert again.step == 4 and again.optimizer.steps == 2
        assert any(p.tensor.any() for p in again.optimizer.pieces() if p.role == "momentum")
    finally:
        again.close()
    with pytest.raises(OptimizerMismatchError, match="written by muon, this run uses adamw"):
        train(TrainConfig(run_dir=run, **{**common, "optimizer": "adamw", "steps": 5}))


def test_cli_trains_muon_and_the_tools_work_on_its_checkpoints(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    args = [
        "--model",
        "zaya-tiny",
        "--run-dir",
        run,
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--cpu",
        "--optimizer",
        "muon",
        "--muon-momentum",
        "0.9",
        "--muon-ns-steps",
        "4",
    ]
    code, out, err = moeckpt_cli("train", *args, "--steps", "4", "--save-every", "2", "--ep", "1")
    assert code == 0, err
    assert "step 4/4" in out
    code, out, _ = moeckpt_cli("inspect", run, "--json")
    info = json.loads(out)
    assert code == 0 and info["roles"]["momentum"]["tensors"] == 20
    assert moeckpt_cli("verify", run)[0] == 0
    code, _, err = moeckpt_cli("reshard", run, tmp_path / "resharded", "--tp", "2", "--ep", "2", "--dp", "2")
    assert code == 0, err
    code, out, err = moeckpt_cli("diff", run, tmp_path / "resharded")
    assert code == 0, (out, err)
    hyper = CheckpointReader(str(run)).index.train_state["optimizer"]["hyperparameters"]
    assert hyper["momentum"] == 0.9 and hyper["ns_steps"] == 4
    code, _, err = moeckpt_cli("train", *args[:-6], "--steps", "6")  # adamw on muon's state
    assert code == 2 and "written by muon" in err and len(err.strip().splitlines()) == 1
    code, out, err = moeckpt_cli("train", *args, "--steps", "6", "--keep-last", "1")
    assert code == 0 and "step 6/6" in out, err
    assert [s for s, _ in committed_steps(str(run))] == [6]
    for bad in ("nan", "1", "-0.5"):
        code, _, err = moeckpt_cli("train", *args[:-4], "--muon-momentum", bad, "--steps", "7")
        # one line naming the option (the CLI's rule for every hostile value), no traceback
        assert code == 2 and "'--muon-momentum'" in err and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err, err
    for opt, value in (
        ("--muon-ns-steps", "0"),
        ("--muon-ns-steps", "x"),
        ("--optimizer", "sgd"),
        ("--muon-scheme", "broadcast"),
    ):
        code, _, err = moeckpt_cli("train", "--model", "zaya-tiny", "--run-dir", tmp_path / "r2", opt, value)
        assert code == 2 and opt in err, err


def test_train_config_refuses_hostile_optimizer_fields(tmp_path):
    for field, value in (
        ("optimizer", "sgd"),
        ("muon_momentum", float("nan")),
        ("muon_momentum", float("inf")),
        ("muon_momentum", "0.9"),
        ("muon_momentum", True),
        ("muon_ns_steps", 0),
        ("muon_ns_steps", 1.5),
        ("muon_ns_steps", 10**6),
        ("muon_scheme", ""),
        ("reset_optimizer", "yes"),
    ):
        with pytest.raises(ValueError, match=field):
            TrainConfig(model="zaya-tiny", run_dir=str(tmp_path), **{field: value})


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the drill walks /proc to kill a node")
def test_elastic_drill_under_muon(tmp_path):
    """The CPU drill of testing/elastic_drill.py with --optimizer muon: real torchrun agents, one node killed, one
    joining; the world shrinks to 2 workers and grows back to 4, each resuming Muon's state resharded."""
    run = str(tmp_path / "run")
    steps = CPU_DRILL_STEPS  # long enough for node C to join before the survivors finish
    result = run_shrink_grow_drill(
        run,
        cpu_drill_args(run, steps=steps) + ["--optimizer", "muon"],
        nproc=2,
        kill_at_step=CPU_DRILL_KILL_AT,
        timeout_s=400,
    )
    # the steps lost with node B are trained again by 2 workers from the same weights and momentum
    check_shrink_and_grow(result, steps)
    index = CheckpointReader(run).index
    assert index.train_state["optimizer"]["name"] == "muon" and index.layout["dp"] == 4
