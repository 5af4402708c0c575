"""Stopping a job from outside, and a job that restarts itself: real launchers, real 2-worker runs, real signals
(to the launcher's pid and to its whole process group), and ``/proc`` to prove that no worker survives."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from moeckpt.formats.checkpoint import committed_steps
from moeckpt.trainer.metrics import read_metrics

from ..proc_helpers import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc to find the workers"),
]

TRAIN = (
    "train",
    "--model",
    "zaya-tiny",
    "--seq-len",
    "16",
    "--global-batch",
    "4",
    "--cpu",
    "--warmup-steps",
    "1",
    "--nproc",
    "2",
)
#: a run too long to finish before the signal: 2000 steps, a checkpoint every 50
LONG = (*TRAIN, "--steps", "2000", "--save-every", "50", "--log-every", "100")


def _wait_for_training(run_dir: str, launched, timeout: float = 120) -> None:
    """Until the workers have trained a step (so the signal meets a running loop, not start-up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        launched.watch()
        if read_metrics(run_dir):
            return
        assert launched.proc.poll() is None, launched.proc.communicate()
        time.sleep(0.2)
    raise AssertionError("no step trained in time")


def _clean(err: str) -> None:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "SignalException" not in err, err


def test_sigterm_to_the_launcher_saves_and_exits_0(tmp_path):
    run = str(tmp_path / "run")
    job = launch(*LONG, "--run-dir", run)
    job.wait_for_workers(2)
    _wait_for_training(run, job)
    job.signal(signal.SIGTERM, group=False)
    code, out, err = job.finish()
    assert code == 0, err
    _clean(err)
    assert job.survivors() == [] and len(job.seen) >= 3  # the agent and both workers were seen, and are gone
    step = int(out.split("stopped by SIGTERM at step ")[1].split("/")[0])
    assert committed_steps(run)[-1][0] == step == read_metrics(run)[-1]["step"]


def test_workers_that_saved_on_sigterm_exit_by_themselves(tmp_path):
    """The agent passes SIGTERM on and waits for the workers: each saves, returns and exits on its own, none is
    left for the agent to kill once its --shutdown-timeout runs out (torch's own records, shown with -vv)."""
    run = str(tmp_path / "run")
    job = launch("-vv", *LONG, "--run-dir", run)
    job.wait_for_workers(2)
    _wait_for_training(run, job)
    job.signal(signal.SIGTERM, group=False)
    code, out, err = job.finish()
    assert code == 0 and "stopped by SIGTERM" in out, err[-3000:]
    assert "torchrun: Closing process" in err, err[-3000:]  # the agent passed the signal on: the path under test
    assert "Unable to shutdown process" not in err and "forcefully exiting" not in err, err[-3000:]
    assert job.survivors() == []


def test_ctrl_c_to_the_process_group_is_one_line_and_130(tmp_path):
    run = str(tmp_path / "run")
    job = launch(*LONG, "--run-dir", run)
    job.wait_for_workers(2)
    _wait_for_training(run, job)
    job.signal(signal.SIGINT, group=True)  # what Ctrl-C in a terminal does
    code, _, err = job.finish()
    assert code == 130
    _clean(err)
    assert err.strip().splitlines()[-1] == "moeckpt: interrupted (SIGINT): stopped the 2 train workers", err
    assert job.survivors() == []


def test_sighup_to_the_process_group_stops_train(tmp_path):
    run = str(tmp_path / "run")
    job = launch(*LONG, "--run-dir", run)
    job.wait_for_workers(2)
    job.signal(signal.SIGHUP, group=True)  # the terminal went away, maybe during start-up
    code, _, err = job.finish()
    assert code == 129 and job.survivors() == []
    _clean(err)


def test_ctrl_c_to_eval_stops_its_workers(tmp_path, moeckpt_cli):
    ck = str(tmp_path / "ck")
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny")[0] == 0
    job = launch("eval", ck, "--nproc", "2", "--cpu", "--seq-len", "16", "--batch-size", "4", "--batches", "6000")
    job.wait_for_workers(2)
    time.sleep(3)
    job.signal(signal.SIGINT, group=False)  # only the launcher: it must stop the workers itself
    code, _, err = job.finish()
    assert code == 130 and job.survivors() == [], err
    _clean(err)


def test_the_elastic_path_saves_on_sigterm(tmp_path):
    from moeckpt.trainer.local_world import free_port

    run = str(tmp_path / "run")
    job = launch(
        *LONG,
        "--run-dir",
        run,
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-conf",
        "last_call_timeout=1",
    )
    job.wait_for_workers(2)
    _wait_for_training(run, job)
    job.signal(signal.SIGTERM, group=True)
    code, out, err = job.finish()
    assert code == 0 and "stopped by SIGTERM" in out, err
    _clean(err)
    assert job.survivors() == []
    assert committed_steps(run)[-1][0] == read_metrics(run)[-1]["step"]


def test_the_demo_stops_and_reaps_its_nodes(tmp_path):
    job = launch("demo", "--dir", tmp_path / "demo")
    job.wait_for_workers(4, timeout=180)  # both nodes' workers run
    job.signal(signal.SIGTERM, group=False)
    code, _, err = job.finish()
    assert code == 128 + signal.SIGTERM and job.survivors() == [], err
    assert len(job.seen) >= 8  # 2 node launchers, 2 agents, 4 workers
    _clean(err)


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_ctrl_c_in_the_first_second_is_one_line(delay, tmp_path):
    job = launch("train", "--model", "zaya-tiny", "--cpu", "--run-dir", tmp_path / "run", "--steps", "5000")
    time.sleep(delay)
    job.signal(signal.SIGINT, group=True)
    code, _, err = job.finish()
    assert code == 130 and err.strip() == "moeckpt: interrupted", err


# -- automatic restart on one node -------------------------------------------------------------------------


def test_a_hung_worker_restarts_the_workers_from_the_newest_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    job = launch(
        *TRAIN,
        "--run-dir",
        run,
        "--steps",
        "8",
        "--save-every",
        "3",
        "--hang-timeout",
        "5",
        "--inject",
        "hang:rank=1,step=5",
    )
    code, out, err = job.finish(timeout=240)
    assert code == 0, err
    assert "step 8/8" in out
    # the terminal gets one line per hung worker naming its report, and one for the restart; no thread stacks
    hung = [line for line in err.splitlines() if line.startswith("moeckpt: error: watchdog")]
    assert hung and all("hang-rank" in line and run in line for line in hung), err
    assert "restarting the workers (restart 1 of 3)" in err
    assert 'File "' not in err and "Thread 0x" not in err, err
    assert "Current thread" in open(os.path.join(run, "hang-rank1.txt")).read()
    resumes = [e for e in read_metrics(run, events=True) if e.get("event") == "resume"]
    assert [r["step"] for r in resumes] == [3]
    assert committed_steps(run)[-1][0] == 8
    assert job.survivors() == []


def test_without_restarts_left_a_killed_worker_ends_the_job_in_one_line(tmp_path):
    run = str(tmp_path / "run")
    job = launch(
        *TRAIN,
        "--run-dir",
        run,
        "--steps",
        "8",
        "--save-every",
        "2",
        "--max-restarts",
        "0",
        "--sync-save",
        "--inject",
        "kill:rank=1,step=3",
    )
    code, _, err = job.finish(timeout=240)
    assert code == 1, err
    _clean(err)
    assert "no restart is left (--max-restarts 0)" in err and "exited with code 137" in err, err
    assert [s for s, _ in committed_steps(run)] == [2] and job.survivors() == []


def test_the_agent_gets_only_options_this_torch_knows():
    """torch 2.11's elastic agent has no --shutdown-timeout and refuses it (exit 2): it is passed only where known."""
    from moeckpt.trainer.launch import SHUTDOWN_TIMEOUT_S, agent_options, shutdown_args, torchrun_command

    assert "--nproc-per-node" in agent_options()
    assert shutdown_args(frozenset({"--nproc-per-node"})) == []
    assert shutdown_args(frozenset({"--shutdown-timeout"})) == [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"]
    command = torchrun_command("train", {}, 2)
    assert (f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}" in command) == ("--shutdown-timeout" in agent_options())
