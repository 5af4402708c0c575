"""Module-level worker functions for the multi-process trainer tests (spawned processes import them by name)."""

from __future__ import annotations

import torch


def train_runs(rank: int, configs: list[dict]) -> None:
    """Run each train config in turn on this rank of a gloo world (results land in each run's metrics.jsonl)."""
    from moeckpt.trainer.train import TrainConfig, train

    torch.set_num_threads(1)
    for cfg in configs:
        train(TrainConfig.from_json(cfg))


def eval_run(rank: int, config: dict, out: str) -> None:
    """Evaluate a checkpoint on this rank; rank 0 writes the loss to ``out``."""
    import json

    from moeckpt.trainer.evaluate import EvalConfig, evaluate

    torch.set_num_threads(1)
    loss = evaluate(EvalConfig(**config))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": loss}, f)


def expert_dispatch_check(rank: int, routes: tuple[str, ...]) -> None:
    for route in routes:
        _expert_dispatch_check(rank, route)


def _expert_dispatch_check(rank: int, route: str) -> None:
    """EP dispatch over 2 ranks equals one process's ``Experts.forward`` on both ranks' tokens, forward and backward.

    ``route="rank0"`` sends every token (and the skip expert) to rank 0's experts, so rank 1 receives nothing and
    must still take part in the backward all-to-all.
    """
    import torch.distributed as dist

    from moeckpt.trainer.distributed import expert_parallel_forward
    from moeckpt.trainer.models.layers import Experts, Shard

    torch.manual_seed(0)
    num, hidden, inter, tokens, k = 4, 16, 8, 6, 2
    full = Experts(num, hidden, inter)
    with torch.no_grad():
        full.gate_up_proj.normal_()
        full.down_proj.normal_()
    xs = [torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]
    if route == "rank0":
        idx = [torch.tensor([[0, 1], [1, 4], [0, 4], [1, 0], [4, 1], [0, 1]]) for _ in range(2)]
    else:
        idx = [
            torch.randint(0, num + 1, (tokens, k), generator=torch.Generator().manual_seed(20 + r)) for r in range(2)
        ]
    ws = [torch.rand(tokens, k, generator=torch.Generator().manual_seed(30 + r)) for r in range(2)]

    # Reference: one process, both ranks' tokens.
    x_ref = torch.cat(xs).requires_grad_()
    w_ref = torch.cat(ws).requires_grad_()
    out_ref = full(x_ref, torch.cat(idx), w_ref)
    (out_ref * torch.arange(out_ref.numel()).view_as(out_ref).sin()).sum().backward()

    local = Experts(num, hidden, inter, Shard(ep=2, ep_rank=rank))
    lo, hi = local.expert_start, local.expert_stop
    with torch.no_grad():
        local.gate_up_proj.copy_(full.gate_up_proj[lo:hi])
        local.down_proj.copy_(full.down_proj[lo:hi])
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    out = expert_parallel_forward(local, x, idx[rank], w, group=dist.group.WORLD, ep=2)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    weight = torch.arange(out_ref.numel()).view_as(out_ref).sin()[rows]
    (out * weight).sum().backward()
    torch.testing.assert_close(out, out_ref[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w_ref.grad[rows], rtol=1e-5, atol=1e-5)
    # Expert gradients already sum every rank's tokens (the all-to-all backward), as ZeroAdamW expects.
    for mine, ref in ((local.gate_up_proj, full.gate_up_proj), (local.down_proj, full.down_proj)):
        got = mine.grad if mine.grad is not None else torch.zeros_like(mine)
        torch.testing.assert_close(got, ref.grad[lo:hi], rtol=1e-5, atol=1e-5)


def memory_run(
    rank: int,
    config: dict,
    steps: int,
    persist_at: tuple[int, ...],
    memory_at: tuple[int, ...],
    node: str | None = None,
) -> None:
    """Train ``steps`` steps of ``config`` and stop as a crash would (no final save, memory tier left in place),
    saving persistently after the steps in ``persist_at`` and into the memory tier after those in ``memory_at``;
    ``node`` (``{rank}`` formatted) names this rank's simulated node."""
    import os

    from moeckpt.trainer.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    if node is not None:
        os.environ["MOECKPT_NODE"] = node.format(rank=rank)
    trainer = Trainer(TrainConfig.from_json(config))
    for _ in range(steps):
        trainer.train_step()
        if trainer.step in persist_at or trainer.step in memory_at:
            trainer.checkpoints.wait()  # else a memory-only save due while one is in flight would be left out
            trainer.save(persist=trainer.step in persist_at, memory=trainer.step in memory_at)
    trainer.checkpoints.wait()
    trainer.metrics.flush()


def train_on_nodes(rank: int, config: dict, nodes: tuple[str, ...]) -> None:
    """``train(config)`` with rank ``r`` on simulated node ``nodes[r]`` (``$MOECKPT_NODE``)."""
    import os

    from moeckpt.trainer.train import TrainConfig, train

    torch.set_num_threads(1)
    os.environ["MOECKPT_NODE"] = nodes[rank]
    train(TrainConfig.from_json(config))


def slow_persist_run(
    rank: int, config: dict, persist_at: tuple[int, ...], kill_at: int, step_s: float, out: str
) -> None:
    """Train to ``kill_at`` on a ``slow://`` run directory, each step taking at least ``step_s`` seconds (a real
    model's step is longer than a memory save; zaya-tiny's is not), saving persistently after the steps in
    ``persist_at`` and into the memory tier every ``memory_every`` steps (as :meth:`Trainer.run` does); at
    ``kill_at`` (every rank at once) record what a kill would find committed, into ``out`` (rank 0): the memory
    checkpoints of this node and the persisted steps, whether the persistent save is still being written, and every
    save's step, blocked seconds and whether it was left out. Then wait for the saves in flight."""
    import json
    import time

    import torch.distributed as dist

    import moeckpt.testing.slow  # noqa: F401 - registers slow://
    from moeckpt.formats.checkpoint import committed_steps
    from moeckpt.trainer.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    cfg = TrainConfig.from_json(config)
    trainer = Trainer(cfg)
    while trainer.step < kill_at:
        t0 = time.perf_counter()
        trainer.train_step()
        time.sleep(max(0.0, step_s - (time.perf_counter() - t0)))
        persist = trainer.step in persist_at
        memory = trainer.step % cfg.memory_every == 0
        if persist or memory:
            trainer.save(persist=persist, memory=memory)
    # The kill: what is committed now, on every rank at the same moment, is all a new world could resume from.
    dist.barrier(group=trainer.checkpoints.decide_group)
    memory_steps = [s for s, _ in committed_steps(trainer.memory.node_dir)]
    persisted = [s for s, _ in committed_steps(cfg.run_dir)]
    inflight = trainer.checkpoints._inflight
    persisting = inflight is not None and inflight.thread.is_alive()
    history = [
        {
            "step": s.step,
            "persisted": s.persisted,
            "skipped": s.skipped,
            "blocked_s": s.blocked_s,
            "memory_s": s.memory.seconds if s.memory is not None else None,
        }
        for s in trainer.checkpoints.history
    ]
    trainer.checkpoints.wait()
    trainer.metrics.flush()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "memory_steps": memory_steps,
                    "persisted": persisted,
                    "persisting": persisting,
                    "history": history,
                    "persist_s": [s.persist_s for s in trainer.checkpoints.history if s.persisted],
                },
                f,
            )


def sharded_logits_check(rank: int, preset: str, layout_json: dict, reference: str, out_dir: str) -> None:
    """This rank's shard of ``preset``'s model in a layout, loaded with the boxes its plan gives it from the full
    state in ``reference`` (a safetensors file with ``ids`` and transformers' ``logits`` besides the weights): the
    vocabulary slices gathered over TP, writes the largest difference to transformers' logits to
    ``out_dir/rank<r>.json``."""
    import json
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from moeckpt.reshard.layout import Layout
    from moeckpt.reshard.placement import model_parallel_boxes
    from moeckpt.reshard.tensors import logical_tensors
    from moeckpt.trainer.distributed import build_parallel_model
    from moeckpt.trainer.models import presets
    from moeckpt.trainer.parallel import build_groups

    torch.set_num_threads(1)
    spec = presets()[preset]
    layout = Layout.from_json(layout_json)
    groups = build_groups(layout)
    c = groups.coords
    full = load_file(reference)
    ids, want = full.pop("ids"), full.pop("logits")
    local = {}
    for name, entry in logical_tensors(spec.param_specs()).items():
        boxes = model_parallel_boxes(entry, layout, c.tp_rank, c.ep_rank)
        dim = entry.sharding["tp"]["dim"] if "tp" in entry.sharding else 0
        local[name] = torch.cat([full[name][b.slices()] for b in boxes], dim=dim)
    model = build_parallel_model(spec, groups).eval()
    model.load_state_dict(local, strict=True)
    with torch.no_grad():
        part = model(ids).contiguous()
    parts = [torch.empty_like(part) for _ in range(layout.tp)]
    dist.all_gather(parts, part, group=groups.tp)
    got = torch.cat(parts, dim=-1)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"shape": list(got.shape), "max_abs_diff": float((got - want).abs().max())}, f)


def logits_then_train(rank: int, logits_args: tuple, configs: list[dict]) -> None:
    """:func:`sharded_logits_check`, then :func:`train_runs`: several claims in one world (one process start)."""
    sharded_logits_check(rank, *logits_args)
    train_runs(rank, configs)
