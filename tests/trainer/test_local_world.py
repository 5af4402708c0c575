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


def _record_where(rank: int, out: str) -> None:
    import sys

    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{os.environ.get('MOECKPT_TEST_WORLD_VAR')}\n{os.getcwd()}\n{'torch' in sys.modules}\n")


@pytest.mark.slow
@pytest.mark.parametrize("forkserver", [True, False], ids=["forkserver", "spawn-fallback"])
def test_each_rank_gets_the_callers_environment_and_directory_of_the_call(tmp_path, monkeypatch, forkserver):
    """The ranks are forked from a server started at the first world (possibly by another test, with another
    environment): each still sees the variables and working directory of the call, as a spawned one does; where
    the platform has no fork server, they are spawned."""
    import multiprocessing

    from moeckpt.trainer import local_world

    if not forkserver:
        monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert local_world._start_method() == ("forkserver" if forkserver else "spawn")
    for value in ("first", "second"):  # the second world comes from the same server, if any
        out = tmp_path / value
        out.mkdir()
        monkeypatch.setenv("MOECKPT_TEST_WORLD_VAR", value)
        monkeypatch.chdir(out)
        run_local_world(_record_where, 2, str(out))
        for rank in range(2):
            assert (out / f"rank{rank}.txt").read_text().splitlines() == [value, str(out), "True"]
