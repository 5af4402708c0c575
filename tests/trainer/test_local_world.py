"""The local gloo world of the tests: an abort after every rank finished its work is teardown, not a failure."""

from __future__ import annotations

import atexit
import os

import pytest

from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.parallel import LaunchError


def _abort_at_exit(rank: int, marks: str) -> None:
    with open(os.path.join(marks, f"ran{rank}"), "w"):
        pass
    if rank == 1:
        atexit.register(os.abort)  # as torch's gloo teardown rarely does, after the work


def _abort_midway(rank: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        os.abort()
    dist.barrier()


@pytest.mark.slow
def test_an_abort_in_teardown_after_every_rank_finished_is_not_a_failure(tmp_path):
    run_local_world(_abort_at_exit, 2, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ran0", "ran1"]


@pytest.mark.slow
def test_an_abort_before_the_work_is_done_still_fails(tmp_path):
    import torch.multiprocessing as mp

    # rank 0's barrier fails too (connection reset): whichever the parent reports, the abort is named
    with pytest.raises((mp.ProcessExitedException, LaunchError), match="SIGABRT"):
        run_local_world(_abort_midway, 2, timeout_s=60)
