"""Muon's reference and the module-level worker functions of its multi-process tests (spawned processes import
them by name).

The reference is the rule written plainly on the global tensors: the data-parallel mean gradient, clipping by the
global norm, ``momentum.lerp_(g, 1 - mu)``, Nesterov ``g.lerp(momentum, mu)``, every logical matrix (each expert,
each block) orthogonalized on its own, ``p *= 1 - lr * wd; p -= lr * 0.2 * sqrt(max(rows, cols)) * O``, and
``torch.optim.AdamW`` for the parameters that are not matrices.
"""

from __future__ import annotations

import math
import zlib

import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import model_parallel_boxes
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import Matrices, ParamSpec

M = Matrices()
#: every kind of rule and of matrix: column/row TP, experts with fused gate/up blocks split by TP, experts split on
#: their last dim, a TP-replicated matrix, unequal fused blocks (q/k), value windows (a TP rank owns none of one),
#: a dim 0 that 4 does not divide, and element-wise tensors (a vector, a scalar, an expert bias).
SPECS = [
    ParamSpec(name="col", shape=(8, 6), rule=ShardingRule(tp=TpSplit(dim=0)), matrix=M),
    ParamSpec(name="row", shape=(6, 8), rule=ShardingRule(tp=TpSplit(dim=1)), matrix=M),
    ParamSpec(
        name="fused",
        shape=(4, 12, 5),
        rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(6, 6))),
        matrix=Matrices(batch_dim=0, blocks=(6, 6)),
    ),
    ParamSpec(
        name="down", shape=(4, 5, 6), rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2)), matrix=Matrices(batch_dim=0)
    ),
    ParamSpec(name="expert_bias", shape=(4, 3), rule=ShardingRule(expert_dim=0)),
    ParamSpec(name="router", shape=(4, 6), matrix=M),
    ParamSpec(name="norm", shape=(6,)),
    ParamSpec(
        name="qk", shape=(10, 3), rule=ShardingRule(tp=TpSplit(dim=0, blocks=(4, 6))), matrix=Matrices(blocks=(4, 6))
    ),
    ParamSpec(name="v_current", shape=(4, 3), rule=ShardingRule(tp=TpSplit(dim=0, window=(0, 8))), matrix=M),
    ParamSpec(name="v_delayed", shape=(4, 3), rule=ShardingRule(tp=TpSplit(dim=0, window=(4, 8))), matrix=M),
    ParamSpec(name="scale", shape=()),
    ParamSpec(name="odd", shape=(7, 3), matrix=M),
]
LRS = [1e-2, 2e-2, 1.5e-2, 5e-3]
#: the layouts of the issue, by world size.
LAYOUTS = {
    1: Layout(tp=1, ep=1, dp=1),
    2: Layout(tp=1, ep=2, dp=2),
    4: Layout(tp=2, ep=2, dp=2),
    8: Layout(tp=2, ep=1, dp=4),
}


def randn(shape, *key) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    return torch.randn(tuple(shape), generator=g)


def initial(spec: ParamSpec) -> torch.Tensor:
    return randn(spec.shape, "init", spec.name)


def grad(spec: ParamSpec, step: int, data_rank: int) -> torch.Tensor:
    return randn(spec.shape, "grad", spec.name, step, data_rank)


def local_of(full: torch.Tensor, spec: ParamSpec, layout: Layout, rank: int) -> torch.Tensor:
    """The TP/EP-local tensor of ``rank``: its model-parallel boxes concatenated along the TP dim."""
    entry = TensorEntry(
        name=spec.name, shape=spec.shape, dtype="float32", role="param", param=spec.name, sharding=spec.rule.to_json()
    )
    c = layout.coords(rank)
    parts = [full[b.slices()] for b in model_parallel_boxes(entry, layout, c.tp_rank, c.ep_rank)]
    return torch.cat(parts, dim=spec.rule.tp.dim).contiguous() if spec.rule.tp else parts[0].clone()


def logical_matrices(spec: ParamSpec) -> list[tuple]:
    """Index expressions of every logical matrix of ``spec`` in its global tensor."""
    m = spec.matrix
    first = 0 if m.batch_dim is None else 1
    blocks = m.blocks or (spec.shape[first],)
    out = []
    for e in range(1 if m.batch_dim is None else spec.shape[0]):
        r0 = 0
        for b in blocks:
            out.append((slice(r0, r0 + b),) if m.batch_dim is None else (e, slice(r0, r0 + b)))
            r0 += b
    return out


def orthogonalize(mat: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz on one matrix, written out (``b*A + c*A@A`` as two products)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = mat.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def reference(data_ranks: int, config, steps: int = len(LRS), specs=SPECS):
    """The global parameters and momentum buffers after ``steps`` steps of the plain rules (see the module)."""
    aw = config.adamw
    weights = {s.name: initial(s).clone() for s in specs}
    adam = {s.name: torch.nn.Parameter(weights[s.name].clone()) for s in specs if s.matrix is None}
    decay = [p for p in adam.values() if p.dim() >= 2]
    rest = [p for p in adam.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": aw.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=LRS[0],
        betas=(aw.beta1, aw.beta2),
        eps=aw.eps,
    )
    momentum = {s.name: torch.zeros(s.shape) for s in specs if s.matrix is not None}
    dtype = getattr(torch, config.ns_dtype)
    for t in range(steps):
        grads = {s.name: torch.stack([grad(s, t, d) for d in range(data_ranks)]).mean(0) for s in specs}
        if aw.max_grad_norm:
            norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
            grads = {k: g * min(1.0, aw.max_grad_norm / (norm + 1e-6)) for k, g in grads.items()}
        for name, p in adam.items():
            p.grad = grads[name]
        for group in opt.param_groups:
            group["lr"] = LRS[t]
        opt.step()
        for s in specs:
            if s.matrix is None:
                continue
            g, m = grads[s.name], momentum[s.name]
            m.lerp_(g, 1 - config.momentum)
            u = g.lerp(m, config.momentum) if config.nesterov else m
            weights[s.name].mul_(1 - LRS[t] * aw.weight_decay)
            for ix in logical_matrices(s):
                o = orthogonalize(u[ix], config.ns_steps, dtype)
                weights[s.name][ix] -= LRS[t] * 0.2 * math.sqrt(max(o.shape)) * o
    for name, p in adam.items():
        weights[name] = p.data
    return weights, momentum


def distributed_matches_reference(rank: int, schemes: tuple[str, ...], ns_dtypes: tuple[str, ...], tol: dict) -> None:
    """ZeroMuon in this world's layout (:data:`LAYOUTS`) against :func:`reference`, parameters and momentum."""
    import torch.distributed as dist

    from moeckpt.trainer.adamw import AdamWConfig
    from moeckpt.trainer.muon import MuonConfig, ZeroMuon
    from moeckpt.trainer.parallel import ParallelGroups, build_groups

    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    layout = LAYOUTS[world]
    groups = build_groups(layout) if world > 1 else ParallelGroups.single()
    c = groups.coords
    for scheme in schemes:
        for ns_dtype in ns_dtypes:
            # Small buckets, so that several buckets per group are exercised too.
            config = MuonConfig(
                scheme=scheme, ns_dtype=ns_dtype, adamw=AdamWConfig(max_grad_norm=0.5, bucket_mib=0.0001)
            )
            params = {s.name: torch.nn.Parameter(local_of(initial(s), s, layout, rank)) for s in SPECS}
            opt = ZeroMuon(params.items(), SPECS, groups, config)
            for t in range(len(LRS)):
                for s in SPECS:
                    if s.rule.expert_dim is None:
                        g = grad(s, t, c.dp_rank)
                    else:  # EP's all-to-all backward already summed the ep ranks' tokens of this expert group
                        g = sum(grad(s, t, c.edp_rank * layout.ep + e) for e in range(layout.ep))
                    params[s.name].grad = local_of(g, s, layout, rank)
                opt.step(LRS[t])
                opt.zero_grad()
            weights, momentum = reference(layout.dp, config)
            what = f"{layout} {scheme} {ns_dtype} rank {rank}"
            for s in SPECS:
                want = local_of(weights[s.name], s, layout, rank)
                torch.testing.assert_close(
                    params[s.name].data, want, rtol=0, atol=tol[ns_dtype], msg=f"{what} {s.name}"
                )
            pieces = opt.piece_map()
            for s in SPECS:
                if s.matrix is None:
                    continue
                for p in pieces.get(f"momentum/{s.name}", []):
                    torch.testing.assert_close(
                        p.tensor,
                        momentum[s.name][p.box.slices()],
                        rtol=0,
                        atol=1e-6,
                        msg=f"{what} momentum/{s.name} {p.box}",
                    )
            matrices = {s.name for s in SPECS if s.matrix is not None}
            roles = {name.split("/", 1)[0] for name in pieces if name.split("/", 1)[1] in matrices}
            assert roles <= {"momentum"}, (what, roles)  # no AdamW moments for what Muon steps


def weights_survive_resume(rank: int, config: dict) -> None:
    """Train to ``stop_at`` and save; a fresh trainer on the run directory resumes: every tensor it holds (weights,
    masters, momentum, moments) equals, bit for bit, what the first held when it saved."""
    from moeckpt.trainer.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_json(config)
    first = Trainer(cfg)
    try:
        first.run()
        before = {k: v.detach().clone() for k, v in first.local_state().items()}
        steps = first.optimizer.state_dict()
    finally:
        first.close()
    second = Trainer(cfg)
    try:
        after = second.local_state()
        assert second.resumed_from is not None and second.step == cfg.stop_at
        assert sorted(after) == sorted(before)
        for name, value in before.items():
            assert torch.equal(after[name], value), f"rank {rank}: {name} differs after the resume"
        assert second.optimizer.state_dict() == steps
    finally:
        second.close()


def train_runs(rank: int, configs: list[dict]) -> None:
    """Run each train config in turn on this rank of a gloo world."""
    from moeckpt.trainer.train import TrainConfig, train

    torch.set_num_threads(1)
    for cfg in configs:
        train(TrainConfig.from_json(cfg))
