"""DeepSeek-V3 in the bundled trainer: its correction biases held out of the optimizer and moved by the balancing
rule, a bit-exact resume, and in a (tp=2, ep=2, dp=2) world the logits of transformers, the losses of one process
(AdamW and Muon) and a resume from a one-process checkpoint.

Every run trains the same steps of the same data from the same (seed, name) initial weights: 20 under AdamW, as in
test_train_parallel.py, 8 under Muon, as in test_train_muon.py (its bf16 Newton-Schulz may round an element the
other way in another layout, which later steps carry on), with their cross-layout tolerance.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.balancing import balance_routers
from moeckpt.trainer.elastic_drill import CPU_DRILL_KILL_AT, CPU_DRILL_STEPS, cpu_drill_args, run_shrink_grow_drill
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.models import presets
from moeckpt.trainer.train import TrainConfig, train

from ..helpers import check_shrink_and_grow
from ..train_workers import logits_then_train

MODEL = "deepseekv3-tiny"
BASE = {"seq_len": 32, "global_batch": 8, "cpu": True}
#: each optimizer's run: its length, warmup and the step of the checkpoint a resume starts from.
RUNS = {
    "adamw": {"steps": 20, "warmup_steps": 4, "optimizer": "adamw"},
    # Muon at 2e-3: its bf16 Newton-Schulz rounds an element the other way in another layout and the learning rate
    # scales what that does to the loss; at the default 3e-3 (2,2,2) differed by up to 1.4e-4 after 8 steps, at
    # 2e-3 by 5e-5, with fp32 Newton-Schulz by 5e-7 (measured): the layouts compute the same step.
    "muon": {"steps": 8, "warmup_steps": 2, "optimizer": "muon", "lr": 2e-3},
}
HALF = {"adamw": 10, "muon": 4}
#: test_train_parallel.py's and test_train_muon.py's cross-layout tolerance on the loss.
ATOL = 2e-4
RATE = 1e-3  # --bias-update-rate's default
BIASES = [f"model.layers.{x}.mlp.gate.e_score_correction_bias" for x in (1, 2)]  # layer 0 is dense


def _losses(run_dir) -> list[float]:
    by_step = {r["step"]: r["loss"] for r in read_metrics(str(run_dir))}  # the last record of a step wins
    return [by_step[s] for s in sorted(by_step)]


def _config(run_dir, opt: str = "adamw", **kw) -> dict:
    return TrainConfig(model=MODEL, run_dir=str(run_dir), **{**BASE, **RUNS[opt], **kw}).to_json()


def _step(opt: str, step: int | None = None) -> str:
    return f"step-{RUNS[opt]['steps'] if step is None else step:08d}"


def _biases(step_dir) -> list[torch.Tensor]:
    reader = CheckpointReader(str(step_dir))
    return [reader.read_tensor(n) for n in BIASES]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Layout (1,1,1), in this process, AdamW and Muon, each with a checkpoint halfway."""
    root = tmp_path_factory.mktemp("reference")
    out = {"root": root}
    for opt in ("adamw", "muon"):
        train(TrainConfig.from_json(_config(root / opt, opt, save_every=HALF[opt], async_save=False)))
        out[opt] = _losses(root / opt)
        assert len(out[opt]) == RUNS[opt]["steps"]
    return out


@pytest.mark.parametrize("opt", ["adamw", "muon"])
def test_single_process_balances_the_biases_outside_the_optimizer_and_resumes_bit_exactly(reference, tmp_path, opt):
    run, steps, half = reference["root"] / opt, RUNS[opt]["steps"], HALF[opt]
    losses = reference[opt]
    assert losses[-1] < losses[0] - 0.5  # it learns
    index = CheckpointReader(str(run / _step(opt))).index
    for name in BIASES:
        # a weight of the checkpoint, with no optimizer state (ModelSpec.untrained)
        assert [e.role for e in index.tensors.values() if e.param == name] == ["param"]
    others = {e.role for e in index.tensors.values() if e.param not in BIASES}
    assert others == (
        {"param", "exp_avg", "exp_avg_sq", "momentum"} if opt == "muon" else {"param", "exp_avg", "exp_avg_sq"}
    )
    # moved by the rule: every step moves each bias by -RATE, 0 or +RATE, so it sits on that grid
    for bias in _biases(run / _step(opt)):
        grid = bias.double() / RATE
        assert bias.abs().max() > 0 and bias.abs().max() <= steps * RATE * (1 + 1e-5)
        assert torch.allclose(grid, grid.round(), atol=1e-3)

    # half + resume + half == straight, bit for bit, and the biases restored and moved identically
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / _step(opt, half), resumed / _step(opt, half))
    records = train(TrainConfig.from_json(_config(resumed, opt, async_save=False)))
    assert [r["step"] for r in records] == list(range(half + 1, steps + 1))
    assert [r["loss"] for r in records] == losses[half:]
    for got, want in zip(_biases(resumed / _step(opt)), _biases(run / _step(opt))):
        assert torch.equal(got, want)


def test_balancing_rule_moves_towards_the_mean_load_summed_over_ranks():
    """bias += rate * sign(mean - load): an overloaded expert loses rate, an underloaded one gains it, a balanced
    one stays; a rate of 0 holds the biases (the counters are still reset)."""

    class Router(torch.nn.Module):
        def __init__(self, load):
            super().__init__()
            self.e_score_correction_bias = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
            self.load = torch.tensor(load)

        def take_load(self):
            out, self.load = self.load, torch.zeros_like(self.load)
            return out

    a, b = Router([6, 2, 4, 4]), Router([1, 1, 1, 1])
    balance_routers([a, b], 0.25)
    assert a.e_score_correction_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    assert b.e_score_correction_bias.tolist() == [0.0, 0.0, 0.0, 0.0]
    a.load = torch.tensor([9, 0, 0, 0])
    balance_routers([a], 0.0)
    assert a.e_score_correction_bias.tolist() == [-0.25, 0.25, 0.0, 0.0] and a.load.sum() == 0


@pytest.mark.slow  # multi-process
def test_tp2_ep2_dp2_logits_losses_and_resume_from_single_process(reference, tmp_path):
    """One world of 4 ranks: logits equal transformers' with heads, MLPs, experts and vocabulary split; AdamW and
    Muon losses equal the single-process ones; a (1,1,1) checkpoint continues in (2,2,2), biases included."""
    from safetensors.torch import save_file

    from .test_model_parity import perturbed_model, transformers_model

    ours = perturbed_model(MODEL)
    hf = transformers_model(MODEL, ours.state_dict())
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    weights = tmp_path / "reference.safetensors"
    save_file({**{k: v.contiguous() for k, v in ours.state_dict().items()}, "ids": ids, "logits": want}, str(weights))
    layout = Layout(tp=2, ep=2, dp=2)
    parity = tmp_path / "parity"
    parity.mkdir()
    resumed = {}
    for opt in ("adamw", "muon"):
        resumed[opt] = tmp_path / f"resumed-{opt}"
        resumed[opt].mkdir()
        start = _step(opt, HALF[opt])
        shutil.copytree(reference["root"] / opt / start, resumed[opt] / start)
    run_local_world(
        logits_then_train,
        4,
        (MODEL, layout.to_json(), str(weights), str(parity)),
        [
            _config(tmp_path / "adamw", "adamw", tp=2, ep=2),
            _config(tmp_path / "muon", "muon", tp=2, ep=2),
            _config(resumed["adamw"], "adamw", tp=2, ep=2),
            _config(resumed["muon"], "muon", tp=2, ep=2),
        ],
        timeout_s=400,
    )
    for rank in range(4):
        got = json.loads((parity / f"rank{rank}.json").read_text())
        assert got["shape"] == list(want.shape) and got["max_abs_diff"] <= 1e-5, (rank, got)
    for opt in ("adamw", "muon"):
        assert _losses(tmp_path / opt) == pytest.approx(reference[opt], abs=ATOL), opt
        assert _losses(resumed[opt]) == pytest.approx(reference[opt][HALF[opt] :], abs=ATOL), opt
        # integer loads summed over the data-parallel ranks: the same updates in every layout
        ref_biases = _biases(reference["root"] / opt / _step(opt))
        for run in (tmp_path / opt, resumed[opt]):
            assert all(torch.equal(g, w) for g, w in zip(_biases(run / _step(opt)), ref_biases)), (opt, run)
    assert Layout.from_json(CheckpointReader(str(resumed["muon"] / _step("muon"))).index.layout) == layout
    assert presets()[MODEL].untrained() == frozenset(BIASES)


@pytest.mark.parametrize(
    "hf_config,field",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 40}}, "rope scaling"),  # the 671B checkpoints' RoPE
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40}}, "rope scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"topk_group": 3}, "topk_group"),
        ({"num_experts_per_tok": 3}, "num_experts_per_tok"),  # more than one group of 2 holds
        ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
    ],
)
def test_configs_the_module_would_compute_differently_are_refused_by_name(hf_config, field):
    import dataclasses

    from moeckpt.formats.errors import MoeckptError
    from moeckpt.trainer.models.layers import build_model

    base = presets()[MODEL]
    cfg = dataclasses.replace(base.config, hf_config={**base.config.hf_config, **hf_config})
    with pytest.raises(MoeckptError, match=f"deepseek_v3 config: {field}"):
        with torch.device("meta"):
            build_model(dataclasses.replace(base, config=cfg))


def test_cli_refuses_an_unsupported_config_before_any_worker_starts(tmp_path, moeckpt_cli):
    """A DeepSeek-V3 config.json with YaRN RoPE (as the Hub's 671B one) is one line naming the field, exit 2."""
    from moeckpt.trainer.hf_export import hf_module

    spec = presets()[MODEL]
    doc = hf_module(spec).to_hf_config(spec.config)
    doc["rope_scaling"] = {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 1.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    code, _, err = moeckpt_cli("train", "--model", path, "--run-dir", tmp_path / "run", "--nproc", 2, "--cpu")
    assert code == 2 and "rope scaling" in err and "yarn" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_init_with_optimizer_writes_no_state_for_the_biases_and_trains_from_it(tmp_path, moeckpt_cli):
    """``moeckpt init --with-optimizer`` stores the biases as the trainer does (a weight, no moments), so a run
    started from it continues with every tensor of the checkpoint accounted for."""
    code, _, err = moeckpt_cli(
        "init", tmp_path / "ck", "--model", MODEL, "--with-optimizer", "--tp", 2, "--ep", 2, "--dp", 2
    )
    assert code == 0, err
    index = CheckpointReader(str(tmp_path / "ck")).index
    for name in BIASES:
        assert [e.role for e in index.tensors.values() if e.param == name] == ["param"]
    assert len([e for e in index.tensors.values() if e.role == "exp_avg"]) == len(presets()[MODEL].param_specs()) - 2
    records = train(
        TrainConfig(model="", init_from=str(tmp_path / "ck"), run_dir=str(tmp_path / "run"), **BASE, steps=2)
    )
    assert [r["step"] for r in records] == [1, 2]
    assert set(CheckpointReader(str(tmp_path / "run")).index.tensors) == set(index.tensors)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the drill walks /proc to kill a node")
def test_elastic_drill_on_deepseek_v3(tmp_path):
    """The CPU drill of trainer/elastic_drill.py on DeepSeek-V3: real torchrun agents, one node killed, one joining;
    the world shrinks to 2 workers and grows back to 4, each resuming resharded (latent attention, experts over ep 2,
    the correction biases restored as weights), and the steps lost with the node are trained again to the same
    losses."""
    run = str(tmp_path / "run")
    steps = CPU_DRILL_STEPS  # long enough for node C to join before the survivors finish
    result = run_shrink_grow_drill(
        run, cpu_drill_args(run, steps=steps, model=MODEL), nproc=2, kill_at_step=CPU_DRILL_KILL_AT, timeout_s=400
    )
    check_shrink_and_grow(result, steps)
    index = CheckpointReader(run).index
    assert index.model["arch"] == "deepseek_v3" and index.layout["dp"] == 4
    bias = next(n for n in index.tensors if n.endswith("e_score_correction_bias"))
    assert f"exp_avg/{bias}" not in index.tensors  # held out of the optimizer through every restart
