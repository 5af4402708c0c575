"""The trainer's checkpoint manager across 4 real gloo processes: async save, commit, retention, failure."""

from __future__ import annotations

import os

import pytest
from torch.multiprocessing import ProcessExitedException

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.formats.retention import RetentionPolicy
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.local import join_local
from moeckpt.reshard.placement import rank_boxes
from moeckpt.trainer.local_world import run_local_world

from ..helpers import tensors_equal, toy_tensors, toy_values

LAYOUT = Layout(tp=2, ep=2, dp=2)


def _local_state(rank: int, scale: float = 1.0):
    values = toy_values()
    state = {}
    for name, entry in toy_tensors().items():
        full = values(entry) * scale if entry.dtype != "bool" else values(entry)
        state[name] = join_local(entry, LAYOUT, rank, {b: full[b.slices()] for b in rank_boxes(entry, LAYOUT, rank)})
    return state


def _save_worker(rank: int, run_dir: str, fail_rank: int) -> None:
    from moeckpt.trainer.checkpointing import CheckpointManager, SaveFailedError

    mgr = CheckpointManager(
        run_dir,
        tensors=toy_tensors(),
        layout=LAYOUT,
        model={"arch": "toy", "config": {}},
        retention=RetentionPolicy(keep_last=2),
    )
    for step, scale in ((5, 1.0), (10, 2.0), (15, 1.0)):
        stats = mgr.save(step, _local_state(rank, scale), {"step": step, "consumed_samples": step * 8})
        assert stats.blocked_s >= 0 and stats.bytes_written > 0
    mgr.wait()
    if fail_rank >= 0:
        # a rank whose write fails: every rank learns of it, nothing is committed
        if rank == fail_rank:
            mgr.backend.write = _broken_write
        mgr.save(20, _local_state(rank), {"step": 20})
        with pytest.raises(SaveFailedError, match=f"rank {fail_rank}"):
            mgr.wait()
    mgr.close()


def _broken_write(*args, **kwargs):
    raise OSError("disk on fire")


@pytest.mark.parametrize("fail_rank", [-1, 2])
def test_async_distributed_save(tmp_path, fail_rank):
    run_dir = str(tmp_path / "run")
    run_local_world(_save_worker, LAYOUT.world, run_dir, fail_rank, timeout_s=120)
    assert [s for s, _ in committed_steps(run_dir)] == [10, 15]  # retention kept the last two
    reader = CheckpointReader(run_dir)
    assert reader.index.step == 15 and reader.index.train_state["consumed_samples"] == 120
    values = toy_values()
    for name, entry in reader.index.tensors.items():
        assert tensors_equal(reader.read_tensor(name), values(entry)), name
    if fail_rank >= 0:
        leftovers = [n for n in os.listdir(run_dir) if "00000020" in n]
        assert leftovers and all(n.startswith(".") for n in leftovers)  # staging only, never committed


def _killed_worker(rank: int, run_dir: str) -> None:
    from moeckpt.trainer.checkpointing import CheckpointManager
    from moeckpt.trainer.faults import FaultInjector, parse_fault

    faults = FaultInjector([parse_fault("kill-during-save:rank=1,step=10")], rank=rank, marker_dir=run_dir)
    mgr = CheckpointManager(
        run_dir, tensors=toy_tensors(), layout=LAYOUT, model={"arch": "toy", "config": {}}, faults=faults
    )
    for step in (5, 10):
        mgr.save(step, _local_state(rank), {"step": step})
        mgr.wait()


@pytest.mark.slow
def test_process_killed_during_save_leaves_previous_checkpoint(tmp_path):
    run_dir = str(tmp_path / "run")
    with pytest.raises((RuntimeError, ProcessExitedException)):  # a LaunchError, or the kill itself
        run_local_world(_killed_worker, LAYOUT.world, run_dir, timeout_s=90)
    assert [s for s, _ in committed_steps(run_dir)] == [5]  # the torn step 10 was never committed
    assert CheckpointReader(run_dir).index.step == 5
    assert any(n.startswith(".step-00000010") for n in os.listdir(run_dir))
