"""Process groups of a layout, layout choice, and torchrun-style initialization."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.models import presets
from moeckpt.trainer.parallel import (
    LaunchError,
    ParallelGroups,
    build_groups,
    choose_layout,
    default_backend,
    default_device,
    group_ranks,
    init_from_env,
)


@pytest.mark.parametrize("layout", [Layout(tp=2, ep=2, dp=4), Layout(tp=1, ep=4, dp=4), Layout(tp=4, ep=1, dp=2)])
def test_groups_partition_the_world_by_coordinates(layout):
    groups = group_ranks(layout)
    same = {
        "tp": lambda c: c.dp_rank,
        "dp": lambda c: c.tp_rank,
        "ep": lambda c: (c.tp_rank, c.edp_rank),
        "edp": lambda c: (c.tp_rank, c.ep_rank),
    }
    sizes = {"tp": layout.tp, "dp": layout.dp, "ep": layout.ep, "edp": layout.edp}
    for kind, members in groups.items():
        flat = sorted(r for g in members for r in g)
        assert flat == list(range(layout.world)), kind
        for g in members:
            assert len(g) == sizes[kind]
            assert len({same[kind](layout.coords(r)) for r in g}) == 1, (kind, g)
    # TP innermost: a TP group is a run of consecutive ranks; an EP group is consecutive data-parallel ranks.
    assert all(g == list(range(g[0], g[0] + layout.tp)) for g in groups["tp"])
    for g in groups["ep"]:
        dp_ranks = [layout.coords(r).dp_rank for r in g]
        assert dp_ranks == list(range(dp_ranks[0], dp_ranks[0] + layout.ep))


def test_choose_layout_rules():
    assert choose_layout(8) == Layout(tp=1, ep=8, dp=8)
    assert choose_layout(8, tp=2) == Layout(tp=2, ep=4, dp=4)
    assert choose_layout(8, ep=2) == Layout(tp=1, ep=2, dp=8)
    assert choose_layout(12, max_ep=4) == Layout(tp=1, ep=4, dp=12)
    assert choose_layout(6, max_ep=4) == Layout(tp=1, ep=3, dp=6)
    # The model refuses ep > 2: the largest accepted divisor wins.
    assert choose_layout(8, check=lambda tp, ep: ep <= 2) == Layout(tp=1, ep=2, dp=8)
    with pytest.raises(LayoutError, match="tp=3"):
        choose_layout(8, tp=3)
    with pytest.raises(LayoutError, match="ep=3"):
        choose_layout(8, ep=3)
    with pytest.raises(LayoutError, match="world 1"):
        choose_layout(1, check=lambda tp, ep: False)


def test_choose_layout_with_a_model_check():
    spec = presets()["qwen3moe-tiny"]
    cfg = spec.config
    layout = choose_layout(cfg.num_experts * 2, check=spec.check_layout)
    assert layout.ep == cfg.num_experts and layout.tp == 1
    bad_tp = cfg.num_key_value_heads + 1
    world = bad_tp * 2
    with pytest.raises(LayoutError, match="num_key_value_heads"):
        choose_layout(world, tp=bad_tp, ep=1, check=spec.check_layout)


def test_single_process_groups_and_device():
    assert default_device() == torch.device("cpu") or torch.cuda.is_available()
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"
    g = build_groups(Layout()) if not dist.is_initialized() else ParallelGroups.single()
    assert g.layout == Layout() and g.size("world") == 1 and g.tp is None
    with pytest.raises(LaunchError, match="torchrun"):
        build_groups(Layout(dp=2))


def test_init_from_env_requires_torchrun_variables(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    with pytest.raises(LaunchError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        init_from_env()


def test_init_from_env_under_torchrun_variables():
    from moeckpt.trainer.local_world import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    code = (
        "import torch.distributed as dist\n"
        "from moeckpt.trainer.parallel import init_from_env, build_groups\n"
        "from moeckpt.reshard.layout import Layout\n"
        "dev = init_from_env(timeout_s=30)\n"
        "g = build_groups(Layout(), device=dev)\n"
        "print(dist.get_backend(), dev.type, g.size('dp'), g.dp is not None)\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["gloo", "cpu", "1", "True"]


def _check_groups(rank: int) -> None:
    for layout in (Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=2, dp=4), Layout(tp=2, ep=1, dp=2)):
        g = build_groups(layout)
        assert g.coords == layout.coords(rank)
        for kind, members in group_ranks(layout).items():
            mine = next(m for m in members if rank in m)
            x = torch.tensor([float(rank)])
            dist.all_reduce(x, group=getattr(g, kind))
            assert x.item() == sum(mine), (layout, kind, x.item(), mine)
            assert dist.get_world_size(getattr(g, kind)) == len(mine) == g.size(kind)
            assert dist.get_rank(getattr(g, kind)) == g.rank_in(kind) == mine.index(rank)


@pytest.mark.slow
def test_groups_reduce_over_the_right_ranks():
    run_local_world(_check_groups, 4, timeout_s=90)


def _fail_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("rank one fails on purpose")
    dist.barrier()


@pytest.mark.slow
def test_a_failing_rank_fails_the_world_without_hanging():
    # Rank 0 fails too (its barrier loses its peer); the report must name the root cause, whichever exit the
    # parent happens to notice first.
    for _ in range(3):
        with pytest.raises(LaunchError, match="rank 1 of 2 .*failed first: RuntimeError: rank one fails on purpose"):
            run_local_world(_fail_on_rank_one, 2, timeout_s=60)
