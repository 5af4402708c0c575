"""ZeRO-1 AdamW against torch.optim.AdamW, alone and over gloo worlds of several layouts; its boxes against the plan."""

from __future__ import annotations

import dataclasses
import math
import sys
import zlib

import pytest
import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import model_parallel_boxes, rank_boxes
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import ParamSpec, tensor_name
from moeckpt.trainer.adamw import AdamWConfig, ZeroAdamW
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.models import presets
from moeckpt.trainer.parallel import ParallelGroups, build_groups

#: a toy plan with every kind of rule: column/row TP, fused blocks along dim 1 and dim 0, windows (one TP rank
#: owns none of a window), experts with and without TP, replicated, a scalar, and a dim 0 that 4 does not divide.
SPECS = [
    ParamSpec(name="col", shape=(8, 6), rule=ShardingRule(tp=TpSplit(dim=0))),
    ParamSpec(name="row", shape=(6, 8), rule=ShardingRule(tp=TpSplit(dim=1))),
    ParamSpec(name="fused", shape=(4, 12, 5), rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(6, 6)))),
    ParamSpec(name="down", shape=(4, 5, 6), rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2))),
    ParamSpec(name="expert_bias", shape=(4, 3), rule=ShardingRule(expert_dim=0)),
    ParamSpec(name="router", shape=(4, 6)),
    ParamSpec(name="norm", shape=(6,)),
    ParamSpec(name="qk", shape=(10, 3), rule=ShardingRule(tp=TpSplit(dim=0, blocks=(4, 6)))),
    ParamSpec(name="v_current", shape=(4, 3), rule=ShardingRule(tp=TpSplit(dim=0, window=(0, 8)))),
    ParamSpec(name="v_delayed", shape=(4, 3), rule=ShardingRule(tp=TpSplit(dim=0, window=(4, 8)))),
    ParamSpec(name="scale", shape=()),
    ParamSpec(name="odd", shape=(7, 3)),
]
CONFIG = AdamWConfig(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
STEPS = 4
LRS = [1e-2, 2e-2, 1.5e-2, 5e-3]


def _randn(shape, *key) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(tuple(shape), generator=g)


def initial(spec: ParamSpec) -> torch.Tensor:
    return _randn(spec.shape, "init", spec.name)


def grad(spec: ParamSpec, step: int, data_rank: int) -> torch.Tensor:
    """The gradient of data-parallel rank ``data_rank``'s mean loss at ``step`` (different on every rank)."""
    return _randn(spec.shape, "grad", spec.name, step, data_rank)


def entry(spec: ParamSpec, role: str = "param") -> TensorEntry:
    return TensorEntry(
        name=tensor_name(spec.name, role),
        shape=spec.shape,
        dtype="float32",
        role=role,
        param=spec.name,
        sharding=spec.rule.to_json(),
    )


def local_of(full: torch.Tensor, spec: ParamSpec, layout: Layout, rank: int) -> torch.Tensor:
    """The TP/EP-local tensor of ``rank``: its model-parallel boxes concatenated along the TP dim."""
    c = layout.coords(rank)
    boxes = model_parallel_boxes(entry(spec), layout, c.tp_rank, c.ep_rank)
    parts = [full[b.slices()] for b in boxes]
    return torch.cat(parts, dim=spec.rule.tp.dim).contiguous() if spec.rule.tp else parts[0].clone()


def reference(data_ranks: int, steps: int = STEPS, specs=SPECS, dtype=torch.float32):
    """torch.optim.AdamW + clip_grad_norm_ on the global parameters with the data-parallel mean gradient."""
    params = {s.name: torch.nn.Parameter(initial(s).to(dtype).float()) for s in specs}
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CONFIG.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=LRS[0],
        betas=(CONFIG.beta1, CONFIG.beta2),
        eps=CONFIG.eps,
    )
    for t in range(steps):
        for s in specs:
            params[s.name].grad = torch.stack([grad(s, t, d) for d in range(data_ranks)]).mean(0)
        if CONFIG.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(list(params.values()), CONFIG.max_grad_norm)
        for group in opt.param_groups:
            group["lr"] = LRS[t]
        opt.step()
    return params, opt


def fake_groups(layout: Layout, rank: int) -> ParallelGroups:
    """Groups with coordinates only: enough to build the optimizer's geometry without processes."""
    return ParallelGroups(layout=layout, coords=layout.coords(rank), device=torch.device("cpu"))


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = (actual.float() - expected.float()).abs().max().item() if actual.numel() else 0.0
    assert err <= tol, f"{what}: max abs difference {err:.3g} > {tol}"


@pytest.mark.parametrize("clip", [True, False])
def test_single_process_matches_torch_adamw(clip, monkeypatch):
    config = CONFIG if clip else dataclasses.replace(CONFIG, max_grad_norm=None)
    monkeypatch.setattr(sys.modules[__name__], "CONFIG", config)
    ref, ref_opt = reference(1)
    params = {s.name: torch.nn.Parameter(initial(s)) for s in SPECS}
    opt = ZeroAdamW(params.items(), SPECS, ParallelGroups.single(), config)
    for t in range(STEPS):
        for s in SPECS:
            params[s.name].grad = grad(s, t, 0)
        norm = opt.step(LRS[t])
        opt.zero_grad()
        assert norm > 0.5  # so clipping, when on, is active in every step
    for s in SPECS:
        if not clip:
            # Same element-wise arithmetic as torch's single-tensor AdamW: bitwise equal.
            assert torch.equal(params[s.name].data, ref[s.name].data), s.name
        # With clipping, the norm (summed in fp64 here, fp32 norm-of-norms in torch) may differ by an ulp.
        _close(params[s.name].data, ref[s.name].data, 1e-6, s.name)
        state = ref_opt.state[ref[s.name]]
        pieces = opt.piece_map()
        for role in ("exp_avg", "exp_avg_sq"):
            (piece,) = pieces[tensor_name(s.name, role)]
            _close(piece.tensor, state[role], 1e-6, f"{role} of {s.name}")
    assert opt.state_dict() == {"steps": STEPS}
    assert "master" not in opt.roles("col")


def test_bf16_parameters_keep_fp32_masters():
    specs = [s for s in SPECS if s.name in ("col", "norm", "fused")]
    ref, _ = reference(1, specs=specs, dtype=torch.bfloat16)
    params = {s.name: torch.nn.Parameter(initial(s).to(torch.bfloat16)) for s in specs}
    opt = ZeroAdamW(params.items(), specs, ParallelGroups.single(), CONFIG)
    for t in range(STEPS):
        for s in specs:
            params[s.name].grad = grad(s, t, 0).to(torch.bfloat16)
        opt.step(LRS[t])
    # Reference gradients are fp32; ours were rounded to bf16 first, hence the looser bound.
    pieces = opt.piece_map()
    for s in specs:
        (master,) = pieces[tensor_name(s.name, "master")]
        _close(master.tensor, ref[s.name].data, 2e-2, s.name)
        assert torch.equal(params[s.name].data, master.tensor.to(torch.bfloat16))
        assert params[s.name].dtype == torch.bfloat16


def test_nonfinite_gradient_skips_the_step():
    params = {s.name: torch.nn.Parameter(initial(s)) for s in SPECS[:3]}
    before = {k: v.detach().clone() for k, v in params.items()}
    opt = ZeroAdamW(params.items(), SPECS, ParallelGroups.single(), CONFIG)
    for s in SPECS[:3]:
        params[s.name].grad = grad(s, 0, 0)
    params["col"].grad[0, 0] = float("nan")
    assert math.isnan(opt.step(1e-2))
    assert opt.steps == 0
    for k, v in params.items():
        assert torch.equal(v.data, before[k])


@pytest.mark.parametrize(
    "model,layout",
    [
        ("toy", Layout(tp=2, ep=2, dp=4)),
        ("toy", Layout(tp=1, ep=1, dp=3)),
        ("zaya-tiny", Layout(tp=2, ep=2, dp=4)),
        ("qwen3moe-tiny", Layout(tp=2, ep=2, dp=2)),
    ],
)
def test_pieces_are_the_rank_boxes_of_the_plan(model, layout):
    specs = SPECS if model == "toy" else presets()[model].param_specs()
    full = {s.name: torch.arange(float(torch.Size(s.shape).numel())).reshape(s.shape) for s in specs}
    for rank in range(layout.world):
        params = [(s.name, local_of(full[s.name], s, layout, rank).to(torch.bfloat16)) for s in specs]
        opt = ZeroAdamW(params, specs, fake_groups(layout, rank), CONFIG)
        pieces = opt.piece_map()
        for piece in opt.param_pieces():
            assert torch.equal(piece.tensor.float(), full[piece.param][piece.box.slices()].to(torch.bfloat16).float())
        param_boxes = [(p.param, p.box) for p in opt.param_pieces()]
        assert param_boxes == [(s.name, b) for s in specs for b in rank_boxes(entry(s), layout, rank)]
        for s in specs:
            for role in ("master", "exp_avg", "exp_avg_sq"):
                want = rank_boxes(entry(s, role), layout, rank)
                got = pieces.get(tensor_name(s.name, role), [])
                assert [p.box for p in got] == want, (s.name, role, rank)
                for p in got:
                    assert tuple(p.tensor.shape) == p.box.shape
                    if role == "master":  # the master holds exactly the box of the global tensor
                        expected = full[s.name][p.box.slices()].to(torch.bfloat16).float()
                        assert torch.equal(p.tensor, expected), (s.name, rank, p.box)


LAYOUTS = [Layout(tp=1, ep=1, dp=4), Layout(tp=2, ep=1, dp=2), Layout(tp=1, ep=2, dp=4), Layout(tp=2, ep=2, dp=2)]


def _distributed_matches_reference(rank: int) -> None:
    for layout in LAYOUTS:
        groups = build_groups(layout)
        c = groups.coords
        params = {s.name: torch.nn.Parameter(local_of(initial(s), s, layout, rank)) for s in SPECS}
        # Small buckets, so that several buckets per group are exercised too.
        opt = ZeroAdamW(params.items(), SPECS, groups, dataclasses.replace(CONFIG, bucket_mib=0.0001))
        assert opt.num_buckets >= 6, opt.num_buckets
        ref, ref_opt = reference(layout.dp)
        for t in range(STEPS):
            for s in SPECS:
                if s.rule.expert_dim is None:
                    g = grad(s, t, c.dp_rank)
                else:
                    # EP's all-to-all backward already summed the tokens of the ep ranks of this expert group.
                    g = sum(grad(s, t, c.edp_rank * layout.ep + e) for e in range(layout.ep))
                params[s.name].grad = local_of(g, s, layout, rank)
            opt.step(LRS[t])
            opt.zero_grad()
        for s in SPECS:
            _close(params[s.name].data, local_of(ref[s.name].data, s, layout, rank), 2e-6, f"{layout} {s.name}")
        for name, pieces in opt.piece_map().items():
            role, param = name.split("/", 1)
            state = ref_opt.state[ref[param]][role]
            for p in pieces:
                _close(p.tensor, state[p.box.slices()], 2e-6, f"{layout} {name} {p.box}")


@pytest.mark.slow
def test_distributed_layouts_match_single_process_adamw():
    run_local_world(_distributed_matches_reference, 4, timeout_s=120)


def test_schedule_warmup_cosine_and_resume():
    import json

    from moeckpt.trainer.schedule import LRSchedule, ScheduleConfig

    cfg = ScheduleConfig(lr=1.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    s = LRSchedule(cfg)
    lrs = [s.next() for _ in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and math.isclose(lrs[9], 0.55) and lrs[14:] == [0.1] * 6
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    # Resume from JSON at step 7 continues with the same rates.
    state = json.loads(json.dumps(LRSchedule(cfg).state_dict() | {"steps": 7}))
    resumed = LRSchedule(cfg)
    resumed.load_state_dict(state)
    assert [resumed.next() for _ in range(13)] == lrs[7:]
    with pytest.raises(ValueError, match="decay_steps=2 .* warmup_steps=4"):
        ScheduleConfig(warmup_steps=4, decay_steps=2)
    with pytest.raises(ValueError, match="steps"):
        resumed.load_state_dict({"steps": -1})
