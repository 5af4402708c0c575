"""Fault injection parsing and firing, the watchdog, and the preemption flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from moeckpt.trainer.faults import Fault, FaultInjector, FaultSpecError, parse_fault
from moeckpt.trainer.preemption import PreemptionFlag
from moeckpt.trainer.watchdog import HANG_EXIT_CODE


def test_parse_fault_specs():
    assert parse_fault("kill:rank=1,step=12") == Fault(kind="kill", rank=1, step=12)
    assert parse_fault("nan:step=3") == Fault(kind="nan", step=3)
    assert parse_fault("kill:rank=0,step=2,signal=TERM").signal == "TERM"
    assert parse_fault("slow:step=5,seconds=0.25") == Fault(kind="slow", step=5, seconds=0.25)
    assert parse_fault("slow:step=5,seconds=0.25,world=2") == Fault(kind="slow", step=5, seconds=0.25, world=2)
    for bad in (
        "explode:step=1",
        "kill:rank=1",
        "kill:step=x",
        "nan:step=1,signal=TERM",
        "hang:step=1,when=now",
        "slow:step=1",
        "slow:step=1,seconds=x",
        "slow:step=1,seconds=-1",
        "kill:step=1,seconds=1",
        "kill:step=1,world=2",
        "slow:step=1,seconds=1,world=0",
        "slow:step=1,seconds=1,world=two",
    ):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)


def test_slow_fault_delays_every_step_from_its_step_on(tmp_path):
    inj = FaultInjector([parse_fault("slow:rank=1,step=3,seconds=0.2")], rank=1, marker_dir=str(tmp_path))
    took = []
    for step in range(1, 6):
        t0 = time.perf_counter()
        inj.before_step(step)
        took.append(time.perf_counter() - t0)
    assert all(t < 0.1 for t in took[:2]) and all(t >= 0.2 for t in took[2:]), took
    other_rank = FaultInjector([parse_fault("slow:rank=1,step=1,seconds=5")], rank=0, marker_dir=str(tmp_path))
    t0 = time.perf_counter()
    other_rank.before_step(4)
    assert time.perf_counter() - t0 < 0.1


def test_a_slow_fault_for_one_world_size_delays_only_a_job_of_that_size(tmp_path):
    """``world=2``: the drill's survivors dawdle while they train alone; the job grown back to 4 does not."""
    fault = parse_fault("slow:step=1,seconds=0.2,world=2")
    for world, delayed in ((2, True), (4, False)):
        inj = FaultInjector([fault], rank=0, marker_dir=str(tmp_path), world=world)
        t0 = time.perf_counter()
        inj.before_step(3)
        took = time.perf_counter() - t0
        assert (took >= 0.2) if delayed else (took < 0.1), (world, took)


def test_faults_fire_once_per_run_directory(tmp_path):
    inj = FaultInjector([parse_fault("nan:rank=1,step=4")], rank=1, marker_dir=str(tmp_path))
    assert torch.isfinite(inj.loss(3, torch.tensor(1.0)))
    assert torch.isnan(inj.loss(4, torch.tensor(1.0)))
    again = FaultInjector([parse_fault("nan:rank=1,step=4")], rank=1, marker_dir=str(tmp_path))
    assert torch.isfinite(again.loss(4, torch.tensor(1.0)))  # a restarted worker does not fail twice
    other = FaultInjector([parse_fault("nan:rank=1,step=4")], rank=0, marker_dir=str(tmp_path / "x"))
    assert torch.isfinite(other.loss(4, torch.tensor(1.0)))


def _run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def test_kill_fault_exits_like_a_lost_process(tmp_path):
    r = _run_child(f"""
        from moeckpt.trainer.faults import FaultInjector, parse_fault
        inj = FaultInjector([parse_fault("kill:rank=0,step=2")], rank=0, marker_dir={str(tmp_path)!r})
        for step in range(5):
            inj.before_step(step)
            print("step", step, flush=True)
    """)
    assert r.returncode == 137 and r.stdout.split() == ["step", "0", "step", "1"]


def test_watchdog_ends_a_hung_worker_with_a_report(tmp_path):
    report = tmp_path / "hang-report.txt"
    r = _run_child(f"""
        import time
        from moeckpt.trainer.watchdog import Watchdog
        wd = Watchdog(1.0, report_path={str(report)!r}).start()
        wd.beat("step 3")
        def stuck_in_allreduce():
            time.sleep(60)
        stuck_in_allreduce()
    """)
    assert r.returncode == HANG_EXIT_CODE
    assert "no progress" in r.stderr and "after step 3" in r.stderr
    assert "stuck_in_allreduce" in report.read_text()  # the report says where it hung


def test_preemption_flag_set_by_sigterm():
    flag = PreemptionFlag()
    try:
        assert not flag.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.is_set and flag.agreed()
    finally:
        flag.restore()
