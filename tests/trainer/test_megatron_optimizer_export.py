"""``export-dcp --mapping megatron --megatron-optimizer``: AdamW's state for Megatron-Core's own optimizer
(``megatron-core==0.16.1``, see docs/interop.md).

With Megatron: for each case of :data:`CASES` (a family, an optimizer form, a parameter dtype, Megatron's expert
parallelism), Megatron-Core trains its own GPTModel with its own optimizer (``get_megatron_optimizer``) two steps
and saves model and optimizer with ``dist_checkpointing.save`` (``megatron_optimizer_worker.py write``);
``import-dcp --mapping megatron`` reads that into a moeckpt layout, ``export-dcp --mapping megatron
--megatron-optimizer FORM`` writes it back with the run's hyperparameters and step; then Megatron loads model and
optimizer into fresh objects (every value NaN before) from its own checkpoint and from the export, and takes one
more step on each (``... load``). The loaded parameters, masters, moments, steps and param groups are bit for bit
the same, and so is everything after the step. The export holds the keys and bits Megatron's own save wrote, and
its ``common.pt`` the same common state (the step a number where Megatron's is a 0-d tensor).

Without Megatron: refusals (no step, no learning rate, no optimizer state, the options with another mapping),
where each value comes from, the param groups Megatron makes, and a round trip through the Megatron import.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp import open_dcp
from moeckpt.trainer.interop.megatron_optimizer import (
    Group,
    MegatronOptimizerConfig,
    common_state,
    groups_of,
    resolve,
)

from ..dcp_workers import hf_config_json, hf_dsv3_config_json, hf_mixtral_config_json
from .test_dcp_import import torchrun_worker
from .test_megatron_export import _cli

#: Megatron's layout over the worker's two ranks is TP 1 (Megatron trains MoE layers with TP only under sequence
#: parallelism, which the local spec's torch norms refuse), data parallel 2 or expert parallel 2.
RANKS = 2
#: case -> (family, optimizer form, parameter dtype, Megatron's expert-parallel size, the moeckpt layout it is
#: imported at, the Megatron optimizer classes the form is)
CASES = {
    "qwen3_moe-fp32-plain-ep2": ("qwen3_moe", "plain", "fp32", 2, ["--tp", "2", "--ep", "2", "--dp", "2"],
                                 ["FP32Optimizer", "FP32Optimizer"]),
    "mixtral-bf16-plain-ep1": ("mixtral", "plain", "bf16", 1, ["--tp", "1", "--ep", "2", "--dp", "4", "--format",
                               "zarr"], ["Float16OptimizerWithFloat16Params"]),
    "deepseek_v3-bf16-fully_reshardable-ep2": ("deepseek_v3", "fully_reshardable", "bf16", 2, ["--tp", "2", "--dp",
                                               "3"], ["DistributedOptimizer", "DistributedOptimizer"]),
    "qwen3_moe-fp32-fully_reshardable-ep1": ("qwen3_moe", "fully_reshardable", "fp32", 1, ["--tp", "1", "--dp", "3"],
                                             ["DistributedOptimizer"]),
}  # fmt: skip
CONFIGS = {"qwen3_moe": hf_config_json, "mixtral": hf_mixtral_config_json, "deepseek_v3": hf_dsv3_config_json}
#: what the run's optimizer was given (megatron_optimizer_worker.OPTIMIZER), as export-dcp options: beta1 and eps
#: are Megatron-LM's defaults and left to them
RUN = ["--megatron-step", "2", "--megatron-lr", "1e-3", "--megatron-min-lr", "1e-4", "--megatron-adam-beta2", "0.95",
       "--megatron-weight-decay", "0.1"]  # fmt: skip


@pytest.fixture(scope="module")
def megatron_optimizers(tmp_path_factory) -> dict:
    """Megatron trains and saves every case, moeckpt imports and exports each, Megatron loads both."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    pytest.importorskip("psutil", reason="megatron-core's saver needs psutil")
    root = tmp_path_factory.mktemp("megatron-optimizer")
    cases = []
    for name, (family, form, dtype, ep, _, _) in CASES.items():
        cases.append({"name": name, "family": family, "form": form, "dtype": dtype, "tp": 1, "ep": ep,
                      "own": str(root / f"{name}.own"), "exported": str(root / f"{name}.exported")})  # fmt: skip
    spec = root / "spec.json"
    spec.write_text(json.dumps(cases))
    torchrun_worker("megatron_optimizer_worker.py", "write", str(spec), nproc=RANKS)
    chains: dict = {}
    for case in cases:
        family, form, _, ep, layout, _ = CASES[case["name"]]
        model, ck = root / f"{family}.json", root / f"{case['name']}.ck"
        model.write_text(json.dumps(CONFIGS[family]()))
        chains[case["name"]] = {
            **case,
            "import": _cli("import-dcp", case["own"], ck, *layout, "--mapping", "megatron", "--model", model),
            "export": _cli("export-dcp", ck, case["exported"], "--mapping", "megatron", "--megatron-optimizer", form,
                           "--megatron-ep", ep, *RUN),
        }  # fmt: skip
    torchrun_worker("megatron_optimizer_worker.py", "load", str(spec), str(root / "loaded"), nproc=RANKS)
    by_rank = [json.loads((root / f"loaded.{rank}").read_text()) for rank in range(RANKS)]
    for name, chain in chains.items():
        chain["loaded"] = [got[name] for got in by_rank]
    return chains


def _plain(value):
    """``value`` with its 0-d tensors as numbers (Megatron's ``common_step``)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_loads_the_optimizer_export_bit_for_bit(megatron_optimizers, case):
    chain = megatron_optimizers[case]
    _, form, _, _, _, optimizers = CASES[case]
    for step in ("import", "export"):
        code, _, err = chain[step]
        assert code == 0, (step, err)
    assert "note: Megatron optimizer state written" in chain["export"][2]
    # the export holds exactly the keys Megatron's own save wrote, with the same bits
    mine, theirs = open_dcp(chain["exported"]), open_dcp(chain["own"])
    assert set(mine.tensors) == set(theirs.tensors) and set(mine.values) == set(theirs.values)
    assert any(name.startswith("optimizer.state.exp_avg_sq.") for name in mine.tensors)
    for name in theirs.tensors:
        a, b = theirs.read_tensor(name), mine.read_tensor(name)
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    # and the same common state (param groups, step, the format), the step a number where Megatron's is a tensor
    own_common = torch.load(f"{chain['own']}/common.pt", weights_only=True)
    common = torch.load(f"{chain['exported']}/common.pt", weights_only=True)
    assert repr(_plain(own_common)) == repr(common), (own_common, common)
    # Megatron's own optimizer loads it as it loads its own checkpoint, and takes the same next step
    for rank, got in enumerate(chain["loaded"]):
        for when in ("loaded", "stepped"):
            seen = got[when]
            where = (case, rank, when)
            assert seen["optimizers"] == optimizers, where
            assert seen["compared"] > 50 and seen["missing"] == [] and seen["differ"] == [], (where, seen)
            assert seen["nan"] == [] and seen["groups_equal"], (where, seen)
        assert got["loaded"]["steps"] == [2.0], (case, rank)
        if form == "plain":
            assert got["stepped"]["steps"] == [3.0], (case, rank)
        own_loss, loss = got["loss"]
        assert own_loss == loss, (case, rank)


def _init(moeckpt_cli, path, preset: str, dtype: str, *, optimizer: bool = True) -> None:
    args = ["init", path, "--model", preset, "--tp", "2", "--ep", "2", "--dp", "2", "--dtype", dtype]
    assert moeckpt_cli(*args, *(["--with-optimizer"] if optimizer else []))[0] == 0


def _one_line_refusal(moeckpt_cli, *args) -> str:
    code, out, err = moeckpt_cli(*args)
    assert code == 2 and "Traceback" not in err, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_export_refuses_an_optimizer_without_its_step_or_its_learning_rate(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    _init(moeckpt_cli, ck, "qwen3moe-tiny", "bf16")
    export = ("export-dcp", ck, tmp_path / "out", "--mapping", "megatron", "--megatron-optimizer", "plain")
    assert "pass --megatron-step" in _one_line_refusal(moeckpt_cli, *export)
    assert "pass --megatron-lr" in _one_line_refusal(moeckpt_cli, *export, "--megatron-step", "5")
    assert not (tmp_path / "out").exists()


def test_export_refuses_optimizer_state_the_checkpoint_does_not_hold(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    _init(moeckpt_cli, ck, "mixtral-tiny", "bf16", optimizer=False)
    line = _one_line_refusal(moeckpt_cli, "export-dcp", ck, tmp_path / "out", "--mapping", "megatron",
                             "--megatron-optimizer", "fully_reshardable", *RUN)  # fmt: skip
    assert "exp_avg/" in line and "export without --megatron-optimizer" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (["--mapping", "none", "--megatron-optimizer", "plain"], "go with --mapping megatron"),
        (["--mapping", "megatron", "--megatron-step", "3"], "optimizer='none'"),
        (["--mapping", "megatron", "--megatron-optimizer", "plain", "--megatron-adam-beta2", "1"], "below 1"),
        (["--mapping", "megatron", "--megatron-optimizer", "adam"], "--megatron-optimizer"),
    ],
)
def test_megatron_options_are_refused_where_they_mean_nothing(tmp_path, moeckpt_cli, args, says):
    ck = tmp_path / "ck"
    _init(moeckpt_cli, ck, "qwen3moe-tiny", "fp32")
    code, out, err = moeckpt_cli("export-dcp", ck, tmp_path / "out", *args)
    assert code == 2 and says in err and "Traceback" not in err, (out, err)
    assert not (tmp_path / "out").exists()


def test_values_come_given_then_recorded_then_from_megatron_defaults():
    trained = {
        "optimizer": {"steps": 40, "name": "adamw", "hyperparameters": {"beta1": 0.8, "beta2": 0.95, "eps": 1e-6,
                                                                          "weight_decay": 0.1}},
        "schedule": {"steps": 40, "config": {"lr": 3e-3, "min_lr_ratio": 0.1}},
    }  # fmt: skip
    got = resolve(MegatronOptimizerConfig(optimizer="plain", adam_eps=1e-7), trained, "here")
    assert (got.step, got.lr, got.betas, got.eps, got.weight_decay) == (40, 3e-3, (0.8, 0.95), 1e-7, 0.1)
    assert got.min_lr == pytest.approx(3e-4)
    assert got.sources["adam_eps"] == "given" and got.sources["step"] == "the checkpoint's record"
    # an import from Megatron records nothing: the step and lr are given, the rest Megatron-LM's defaults
    got = resolve(MegatronOptimizerConfig(optimizer="plain", step=7, lr=1e-4), {"step": 0}, "here")
    assert (got.min_lr, got.betas, got.eps, got.weight_decay) == (0.0, (0.9, 0.999), 1e-8, 0.01)
    assert got.sources["adam_beta2"] == "Megatron-LM's default"
    # a run whose optimizer is not AdamW: its hyperparameters are not AdamW's
    muon = {"optimizer": {"steps": 3, "name": "muon", "hyperparameters": {"beta1": 0.5}}}
    assert resolve(MegatronOptimizerConfig(optimizer="plain", lr=1.0), muon, "here").betas == (0.9, 0.999)


def test_param_groups_are_megatrons():
    """The groups ``get_megatron_optimizer`` makes with its standard overrides (measured on its own optimizers):
    experts stepped with the dense parameters without expert parallelism, by an optimizer of their own with it."""
    params = [Group(expert=False, no_weight_decay=False), Group(False, True), Group(True, False)]
    assert groups_of(params, ep=1) == [[Group(False, False), Group(False, True)]]
    assert groups_of(params, ep=2) == [[Group(False, False), Group(False, True)], [Group(True, False)]]
    values = resolve(MegatronOptimizerConfig(optimizer="plain", step=2, lr=1e-3), {}, "here")
    one = common_state("plain", "float32", groups_of(params, 1), values)
    assert one["state"] == {"common_step": 2.0} and [g["wd_mult"] for g in one["param_groups"]] == [1.0, 0.0]
    two = common_state("fully_reshardable", "bfloat16", groups_of(params, 2), values)
    assert sorted(two) == [0, 1] and two[1]["param_state_sharding_type"] == "fully_reshardable"
    assert [g["is_expert_parallel"] for g in two[1]["optimizer"]["param_groups"]] == [True]
    assert {g["step"] for sub in two.values() for g in sub["optimizer"]["param_groups"]} == {2.0}
    assert "optimizer" in common_state("plain", "bfloat16", groups_of(params, 1), values)  # Float16's nesting


#: (preset, parameter dtype, form): the plans and forms a round trip through the Megatron import covers
ROUND_TRIPS = {
    "qwen3_moe-fp32-plain": ("qwen3moe-tiny", "fp32", "plain"),
    "mixtral-bf16-plain": ("mixtral-tiny", "bf16", "plain"),
    "deepseek_v3-bf16-fully_reshardable": ("deepseekv3-tiny", "bf16", "fully_reshardable"),
    "qwen3_moe-fp32-fully_reshardable": ("qwen3moe-tiny", "fp32", "fully_reshardable"),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_optimizer_export_round_trips_through_the_megatron_import(tmp_path, moeckpt_cli, case):
    """Export with AdamW's state, then the Megatron import gives every parameter, moment and master back bit for bit
    (no Megatron needed; an fp32 model's masters are its parameters)."""
    from moeckpt.trainer.models import presets

    preset, dtype, form = ROUND_TRIPS[case]
    model = tmp_path / "model.json"
    model.write_text(json.dumps(presets()[preset].to_json()))
    ck, out, back = tmp_path / "ck", tmp_path / "megatron", tmp_path / "back"
    _init(moeckpt_cli, ck, str(model), dtype)
    code, _, err = moeckpt_cli("export-dcp", ck, out, "--mapping", "megatron", "--megatron-optimizer", form, *RUN)
    assert code == 0 and "step=2 (given)" in err and "adam_beta1=0.9 (Megatron-LM's default)" in err, err
    code, _, err = moeckpt_cli("import-dcp", out, back, "--tp", "1", "--dp", "1", "--mapping", "megatron",
                               "--model", model)  # fmt: skip
    assert code == 0, err
    a, b = CheckpointReader(str(ck)), CheckpointReader(str(back))
    assert set(b.index.tensors) == set(a.index.tensors)
    for name, entry in a.index.tensors.items():
        box = Box.full(entry.shape)
        x, y = a.read_box(name, box), b.read_box(name, box)
        assert x.dtype == y.dtype and torch.equal(x, y), name
