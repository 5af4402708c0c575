"""Muon: Newton-Schulz against torch's, ZeroMuon against torch.optim.Muon and the plain rules, alone and over gloo
worlds in the issue's layouts; the exchange plan of every rank against the others'; the per-tensor rule table."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moeckpt.formats.box import covers_exactly_once
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import rank_boxes
from moeckpt.reshard.tensors import Matrices, ParamSpec, tensor_name
from moeckpt.trainer.adamw import AdamWConfig
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.models import presets
from moeckpt.trainer.muon import MuonConfig, ZeroMuon, newton_schulz
from moeckpt.trainer.muon_plan import families, rank_plan, receives, sends
from moeckpt.trainer.parallel import ParallelGroups

from ..muon_workers import (
    LAYOUTS,
    LRS,
    SPECS,
    distributed_matches_reference,
    grad,
    initial,
    local_of,
    reference,
)


def test_newton_schulz_is_torch_muons_iteration_batched_or_not():
    zeropower = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in ((12, 7), (7, 12), (16, 16)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        assert torch.equal(newton_schulz(x, 5), zeropower(x, coeffs, 5, 1e-7)), shape
        batch = torch.randn(3, *shape, generator=torch.Generator().manual_seed(7))
        one_by_one = torch.stack([zeropower(m, coeffs, 5, 1e-7) for m in batch])
        torch.testing.assert_close(newton_schulz(batch, 5).float(), one_by_one.float(), rtol=0, atol=1e-2)
        # about orthogonal: every singular value near 1 (Keller Jordan's quintic lands them in about [0.7, 1.2])
        sv = torch.linalg.svdvals(newton_schulz(x, 5).float())
        assert sv.min() > 0.5 and sv.max() < 1.5, sv
    assert newton_schulz(torch.randn(5, 4), 5, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("clip", [False, True])
def test_single_process_matches_torch_muon_and_adamw(clip):
    """2-D matrices under torch.optim.Muon with its Moonlight scaling (``adjust_lr_fn="match_rms_adamw"``: lr times
    0.2 * sqrt(max(rows, cols)), weight decay by the unscaled lr, Nesterov), the rest under torch.optim.AdamW."""
    specs = [
        ParamSpec(name="w", shape=(8, 6), matrix=Matrices()),
        ParamSpec(name="v", shape=(6, 8), matrix=Matrices()),
        ParamSpec(name="u", shape=(8, 6), matrix=Matrices()),
        ParamSpec(name="n", shape=(6,)),
        ParamSpec(name="e", shape=(5, 4)),
    ]  # a matrix not marked as one: AdamW
    config = MuonConfig(adamw=AdamWConfig(max_grad_norm=0.5 if clip else None, weight_decay=0.1))
    ours = {s.name: torch.nn.Parameter(initial(s)) for s in specs}
    ref = {s.name: torch.nn.Parameter(initial(s)) for s in specs}
    opt = ZeroMuon(ours.items(), specs, ParallelGroups.single(), config)
    muon = torch.optim.Muon(
        [ref["w"], ref["v"], ref["u"]],
        lr=LRS[0],
        weight_decay=0.1,
        momentum=config.momentum,
        nesterov=True,
        ns_steps=config.ns_steps,
        adjust_lr_fn="match_rms_adamw",
    )
    adamw = torch.optim.AdamW(
        [{"params": [ref["e"]], "weight_decay": 0.1}, {"params": [ref["n"]], "weight_decay": 0.0}],
        lr=LRS[0],
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    for t, lr in enumerate(LRS):
        for s in specs:
            ours[s.name].grad = grad(s, t, 0)
            ref[s.name].grad = grad(s, t, 0)
        if clip:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), 0.5)
        for o in (muon, adamw):
            for group in o.param_groups:
                group["lr"] = lr
        assert opt.step(lr) > 0.5
        opt.zero_grad()
        muon.step()
        adamw.step()
    for s in specs:
        if not clip:  # the same arithmetic, stacked or not: bitwise equal
            assert torch.equal(ours[s.name].data, ref[s.name].data), s.name
        torch.testing.assert_close(ours[s.name].data, ref[s.name].data, rtol=0, atol=1e-6)
    pieces = opt.piece_map()
    for name in ("w", "v", "u"):
        (piece,) = pieces[f"momentum/{name}"]
        torch.testing.assert_close(piece.tensor, muon.state[ref[name]]["momentum_buffer"], rtol=0, atol=1e-6)
    assert opt.roles("w") == ("momentum",) and opt.roles("n") == ("exp_avg", "exp_avg_sq")
    assert [opt.rule_of(s.name) for s in specs] == ["muon", "muon", "muon", "adamw", "adamw"]
    assert opt.state_dict() == {"steps": len(LRS)}
    assert opt.describe()["name"] == "muon" and opt.describe()["hyperparameters"]["momentum"] == 0.95


@pytest.mark.parametrize("ns_dtype,tol", [("float32", 2e-6), ("bfloat16", 2e-3)])
def test_experts_and_fused_blocks_match_the_plain_rules(ns_dtype, tol):
    """Every expert's matrix and every fused block orthogonalized on its own (the reference loops over them with
    Newton-Schulz written out; ours stacks them by shape)."""
    config = MuonConfig(ns_dtype=ns_dtype, adamw=AdamWConfig(max_grad_norm=0.5))
    params = {s.name: torch.nn.Parameter(initial(s)) for s in SPECS}
    opt = ZeroMuon(params.items(), SPECS, ParallelGroups.single(), config)
    for t, lr in enumerate(LRS):
        for s in SPECS:
            params[s.name].grad = grad(s, t, 0)
        opt.step(lr)
    want, momentum = reference(1, config)
    for s in SPECS:
        torch.testing.assert_close(params[s.name].data, want[s.name], rtol=0, atol=tol, msg=s.name)
    # the concatenation is not what was orthogonalized: the fused tensor's update differs from one NS of it whole
    whole = newton_schulz(momentum["fused"][0], dtype=torch.float32)
    halves = torch.cat([newton_schulz(m, dtype=torch.float32) for m in momentum["fused"][0].split(6)])
    assert (whole - halves).abs().max() > 1e-2


@pytest.mark.parametrize("world", [1, 2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_distributed_layouts_match_the_single_process_rules(world):
    """Layouts (1,1,1), (1,2,2), (2,2,2), (2,1,4): both exchange schemes, Newton-Schulz in fp32 (tight) and bf16."""
    run_local_world(
        distributed_matches_reference,
        world,
        ("assign", "gather"),
        ("float32", "bfloat16"),
        {"float32": 2e-6, "bfloat16": 2e-3},
        timeout_s=300,
    )


def test_single_process_without_torch_distributed():
    distributed_matches_reference(0, ("assign",), ("float32",), {"float32": 2e-6})


# ------------------------------------------------------------------------------------------- the exchange plan

PLAN_LAYOUTS = [
    Layout(),
    Layout(tp=1, ep=2, dp=2),
    Layout(tp=2, ep=2, dp=2),
    Layout(tp=2, ep=1, dp=4),
    Layout(tp=1, ep=1, dp=3),
    Layout(tp=2, ep=4, dp=4),
]


def _muon_specs(model: str) -> list[ParamSpec]:
    specs = SPECS if model == "toy" else presets()[model].param_specs()
    return [s for s in specs if s.matrix is not None]


@pytest.mark.parametrize("scheme", ["assign", "gather"])
@pytest.mark.parametrize("model", ["toy", "zaya-tiny", "qwen3moe-tiny", "deepseekv3-tiny"])
def test_every_ranks_plan_agrees_with_the_others(model, scheme):
    """Pure: what rank s sends rank d is what d expects from s, in the same order; every matrix is assembled whole
    exactly where it is computed (once under assign, on every holder under gather); every held piece gets its
    result back exactly once."""
    specs = _muon_specs(model)
    for layout in PLAN_LAYOUTS:
        if model != "toy":
            try:
                presets()[model].check_layout(layout.tp, layout.ep)
            except LayoutError:
                continue
        plans = [rank_plan(specs, layout, r, scheme) for r in range(layout.world)]
        fams = plans[0].families
        for a in plans:
            assert a.families == fams
            for b in plans:
                if a.rank != b.rank:
                    for kind in ("forward", "backward"):
                        sent = [t for t in sends(getattr(a, kind), a.rank) if t.dst == b.rank]
                        got = [t for t in receives(getattr(b, kind), b.rank) if t.src == a.rank]
                        assert sent == got, (layout, kind, a.rank, b.rank)
        computed: dict[tuple[int, int], list[int]] = {}
        for p in plans:
            for ms in p.computes.values():
                for m in ms:
                    computed.setdefault(m, []).append(p.rank)
            # the forward transfers into this rank tile each matrix it computes exactly once
            boxes: dict[tuple[int, int], list] = {m: [] for ms in p.computes.values() for m in ms}
            for t in p.forward:
                if t.dst == p.rank:
                    f = fams[t.family]
                    first, count = f.matrix_of(t.box)
                    for e in range(first, first + count):
                        rows, cols = t.box.shape[-2:]
                        off = (t.offsets[-2] - f.row0, t.offsets[-1])
                        boxes[(f.index, e)].append(type(t.box)(off, (rows, cols)))
            for m, bs in boxes.items():
                assert covers_exactly_once(fams[m[0]].shape, bs) is None, (layout, p.rank, m)
        total = sum(f.batch for f in fams.values())
        assert len(computed) == total
        if scheme == "assign":
            assert all(len(r) == 1 for r in computed.values())
        # every rank gets back exactly the boxes it holds of the momentum, once each
        for p in plans:
            got = [(t.family, t.box) for t in p.backward if t.dst == p.rank]
            for s in specs:
                entry = TensorEntry(
                    name=tensor_name(s.name, "momentum"),
                    shape=s.shape,
                    dtype="float32",
                    role="momentum",
                    param=s.name,
                    sharding=s.rule.to_json(),
                )
                mine = rank_boxes(entry, layout, p.rank)
                fam_ids = {f.index for f in fams.values() if f.param == s.name}
                back = [t.box for t in p.backward if t.dst == p.rank and t.family in fam_ids]
                assert sum(b.numel for b in back) == sum(b.numel for b in mine), (layout, p.rank, s.name)
                for b in back:
                    assert any(z.contains(b) for z in mine)
            assert len(got) == len(set(got))


def test_assignment_keeps_whole_experts_at_home_and_balances():
    """Under assign an expert held whole by its ZeRO owner (tp 1) is orthogonalized there, nothing sent; the
    dense matrices fill the ranks so that the Newton-Schulz work differs by at most one matrix's."""
    spec = presets()["zaya-tiny"]
    specs = _muon_specs("zaya-tiny")
    layout = Layout(tp=1, ep=2, dp=4)
    plans = [rank_plan(specs, layout, r, "assign") for r in range(layout.world)]
    for p in plans:
        assert not [t for t in p.forward if "experts" in p.families[t.family].param and t.src != t.dst]
    loads = [sum(len(ms) * r * c * min(r, c) for (r, c), ms in p.computes.items()) for p in plans]
    biggest = max(r * c * min(r, c) for s in specs for f in families(s, 0) for r, c in [f.shape])
    assert max(loads) - min(loads) <= biggest, loads
    assert spec.config.num_experts == 4


# ------------------------------------------------------------------------------------------- rules and state


def test_rule_table_of_the_bundled_models():
    """Which tensors Muon steps, from the plans (docs/trainer.md gives the reasons)."""
    muon_suffixes = (
        "o_proj.weight",
        "q_proj.weight",
        "k_proj.weight",
        "v_proj_current.weight",
        "v_proj_delayed.weight",
        "v_proj.weight",
        "mlp.gate.down_proj.weight",
        "router_mlp.fc1.weight",
        "router_mlp.fc2.weight",
        "experts.gate_up_proj",
        "experts.down_proj",
    )
    for model in ("zaya-tiny", "qwen3moe-tiny"):
        specs = presets()[model].param_specs()
        params = [(s.name, torch.empty(s.shape)) for s in specs]
        opt = ZeroMuon(params, specs, ParallelGroups.single())
        for s in specs:
            want = "muon" if s.name.endswith(muon_suffixes) else "adamw"
            assert opt.rule_of(s.name) == want, (model, s.name)
        for s in specs:
            if s.name.endswith("gate_up_proj"):
                fs = families(s, 0)
                e, two_i, h = s.shape
                assert [f.shape for f in fs] == [(two_i // 2, h)] * 2 and all(f.batch == e for f in fs)
    names = {s.name for s in presets()["zaya-tiny"].param_specs() if s.matrix is None}
    for adamw in (
        "model.embed_tokens.weight",
        "model.layers.1.mlp.gate.router_mlp.out_proj.weight",
        "model.layers.1.self_attn.qkv_proj.conv_qk_grouped.weight",
        "model.layers.1.mlp.gate.balancing_biases",
        "model.layers.1.self_attn.qk_norm.temp",
        "model.norm.weight",
    ):
        assert adamw in names


def test_rule_table_of_deepseek_v3():
    """DeepSeek-V3: every MLA projection (the low-rank down and up projections alike), the dense and shared-expert
    MLPs and the experts are Muon; the router classifier, norms, embedding and head AdamW; the correction biases,
    held out of the optimizer (``untrained``), are stepped by neither and have no state."""
    muon_suffixes = (
        "q_a_proj.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_b_proj.weight",
        "o_proj.weight",
        "gate_proj.weight",
        "up_proj.weight",
        "down_proj.weight",
        "experts.gate_up_proj",
        "experts.down_proj",
    )
    spec = presets()["deepseekv3-tiny"]
    specs = spec.param_specs()
    held = spec.untrained()
    assert held and all(n.endswith("e_score_correction_bias") for n in held)
    opt = ZeroMuon([(s.name, torch.empty(s.shape)) for s in specs], specs, ParallelGroups.single(), held=held)
    for s in specs:
        want = "held" if s.name in held else "muon" if s.name.endswith(muon_suffixes) else "adamw"
        assert opt.rule_of(s.name) == want, s.name
        assert (opt.roles(s.name) == ()) == (s.name in held), s.name
    assert {p.param for p in opt.param_pieces()} == {s.name for s in specs}  # held ones saved as weights
    assert not {p.param for p in opt.pieces()} & held


def test_bad_matrix_rules_are_refused():
    for spec, what in (
        (ParamSpec(name="x", shape=(4, 3, 2), matrix=Matrices()), "not 2-D"),
        (ParamSpec(name="x", shape=(4, 3), matrix=Matrices(blocks=(2, 1, 2))), "do not split"),
        (ParamSpec(name="x", shape=(4, 3, 2), matrix=Matrices(batch_dim=1)), "batch_dim"),
    ):
        with pytest.raises(LayoutError, match=what):
            families(spec, 0)


@pytest.mark.parametrize("layout", [Layout(tp=2, ep=2, dp=4), Layout(tp=1, ep=1, dp=3)])
def test_momentum_pieces_are_the_rank_boxes_of_the_plan(layout):
    specs = presets()["zaya-tiny"].param_specs()
    full = {s.name: torch.arange(float(math.prod(s.shape))).reshape(s.shape) for s in specs}
    for rank in range(layout.world):
        params = [(s.name, local_of(full[s.name], s, layout, rank).to(torch.bfloat16)) for s in specs]
        groups = ParallelGroups(layout=layout, coords=layout.coords(rank), device=torch.device("cpu"))
        opt = ZeroMuon(params, specs, groups)
        pieces = opt.piece_map()
        for s in specs:
            roles = ("master", "momentum") if s.matrix is not None else ("master", "exp_avg", "exp_avg_sq")
            assert opt.roles(s.name) == roles
            for role in roles:
                entry = TensorEntry(
                    name=tensor_name(s.name, role),
                    shape=s.shape,
                    dtype="float32",
                    role=role,
                    param=s.name,
                    sharding=s.rule.to_json(),
                )
                assert [p.box for p in pieces.get(entry.name, [])] == rank_boxes(entry, layout, rank), (s.name, role)


def test_config_refuses_hostile_values():
    for field, value in (
        ("momentum", float("nan")),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("momentum", "x"),
        ("ns_steps", 0),
        ("ns_steps", 100),
        ("ns_steps", 2.5),
        ("ns_eps", 0.0),
        ("ns_dtype", "fp8"),
        ("update_scale", float("inf")),
        ("scheme", "broadcast"),
        ("ns_coefficients", (1.0, 2.0)),
    ):
        with pytest.raises(ValueError, match=field):
            MuonConfig(**{field: value})
    assert dataclasses.replace(MuonConfig(), scheme="gather").scheme == "gather"


def test_comm_bytes_count_the_exchange_buffers(tmp_path):
    """The exchange's bytes are the send buffers' (bf16); AdamW's part is exactly ZeroAdamW's."""
    from moeckpt.trainer.adamw import ZeroAdamW

    specs = presets()["zaya-tiny"].param_specs()
    layout = Layout(tp=1, ep=2, dp=4)
    for rank in (0, 3):
        params = [(s.name, local_of(initial(s), s, layout, rank)) for s in specs]
        groups = ParallelGroups(layout=layout, coords=layout.coords(rank), device=torch.device("meta"))
        muon = ZeroMuon([(n, t.to("meta")) for n, t in params], specs, groups)
        adamw = ZeroAdamW([(n, t.to("meta")) for n, t in params], specs, groups)
        base = adamw.comm_bytes()
        mine = muon.comm_bytes()
        assert {k: mine[k] for k in base} == base
        assert mine["muon_exchange"] == 2 * sum(
            t.numel for t in muon.plan.forward + muon.plan.backward if t.src == rank != t.dst
        )
        assert mine["muon_exchange"] > 0
    assert LAYOUTS[8] == Layout(tp=2, ep=1, dp=4)
