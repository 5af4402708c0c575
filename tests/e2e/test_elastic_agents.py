"""Elastic resume on torchrun's own elastic agent: two nodes of 2 workers, one node dies, the survivor finishes
alone, a new node joins and the world grows back to 4 (issue 7). Real agents, real c10d rendezvous, gloo, CPU."""

from __future__ import annotations

import os
import sys

import pytest

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.trainer.elastic_drill import CPU_DRILL_KILL_AT as KILL_AT
from moeckpt.trainer.elastic_drill import CPU_DRILL_STEPS as STEPS
from moeckpt.trainer.elastic_drill import DrillResult
from moeckpt.trainer.launch import Elastic, ElasticSpecError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the drill walks /proc to kill a node"),
]


def test_elastic_spec_parsing():
    e = Elastic.parse("1:2", "head:29500", max_restarts=5, conf="last_call_timeout=5")
    assert e.torchrun_args() == [
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=head:29500",
        "--rdzv-id=moeckpt",
        "--max-restarts=5",
        "--rdzv-conf=last_call_timeout=5",
    ]
    assert (Elastic.parse("3", "h:1").min_nodes, Elastic.parse("3", "h:1").max_nodes) == (3, 3)
    for nnodes, endpoint in (("2:1", "h:1"), ("0:2", "h:1"), ("x", "h:1"), ("1:2", None), ("1:2", "head")):
        with pytest.raises(ElasticSpecError):
            Elastic.parse(nnodes, endpoint)


def _drill_of_the_demo(demo_run):
    """The drill ``moeckpt demo`` ran (the suite runs it once): its result, logs and run directory."""
    import json

    _, out, err, root = demo_run
    path = root / "drill.json"
    assert path.exists(), f"the demo wrote no drill result:\n{out[-3000:]}\n{err[-3000:]}"
    logs = {
        p.stem.split("-", 1)[1]: p.read_text(errors="replace") for p in (root / "run" / "drill-logs").glob("node-*.log")
    }
    return DrillResult.from_json(json.loads(path.read_text()), logs), str(root / "run")


@pytest.mark.slow
def test_a_lost_node_shrinks_the_world_and_a_new_node_grows_it_back(demo_run, moeckpt_cli):
    result, run = _drill_of_the_demo(demo_run)
    logs = "\n".join(f"--- node {n}\n{text[-4000:]}" for n, text in result.logs.items())
    assert result.exit_codes == {"A": 0, "C": 0}, logs

    # 4 workers, then 2 after the loss of node B, then 4 again once node C joined; the run reached its last step.
    worlds = result.worlds()
    assert [w for _, w in worlds] == [4, 2, 4], (worlds, logs)
    steps = result.steps()
    assert steps[-1]["step"] == STEPS and steps[-1]["world"] == 4

    # Each change resumed from a committed checkpoint resharded into the new world's layout.
    resumes = [e for e in result.events() if e["event"] == "resume"]
    assert [(r["from_layout"]["dp"], r["to_layout"]["dp"]) for r in resumes] == [(4, 2), (2, 4)], resumes
    shrink, grow = resumes
    # The demo runs with the memory tier (a memory checkpoint every step, persistent ones every 5): the survivors
    # resume from host memory, at a step no older than the last persisted one, reading nothing from storage.
    assert shrink["tier"] == "memory" and shrink["storage_bytes_read"] == 0, shrink
    assert KILL_AT // 5 * 5 <= shrink["step"] <= KILL_AT, shrink
    assert worlds[1][0] == shrink["step"] + 1 and worlds[2][0] == grow["step"] + 1

    # The loss curve continues: the steps lost with node B are trained again by 2 workers from the same weights on
    # the same samples, and give the losses the 4 workers had computed.
    # With the memory tier that is at most one step (none when the kill came after the step's memory commit;
    # tests/trainer/test_memory_tier.py compares a memory resume's losses with an unfailed run's).
    first = {r["step"]: r["loss"] for r in steps if r["world"] == 4 and r["step"] <= worlds[1][0]}
    again = {r["step"]: r["loss"] for r in steps if r["world"] == 2 and r["step"] in first}
    assert sorted(again) == [s for s in sorted(first) if s > shrink["step"]], (first, again, worlds)
    for step, loss in again.items():
        assert loss == pytest.approx(first[step], abs=1e-4), (step, loss, first[step])

    # The last checkpoint is complete, in the grown layout, and every checksum holds.
    last_step, _ = committed_steps(run)[-1]
    assert last_step == STEPS
    reader = CheckpointReader(run)
    assert (reader.index.layout["ep"], reader.index.layout["dp"]) == (2, 4)
    code, out, err = moeckpt_cli("verify", run)
    assert code == 0, (out, err)


def test_workers_warn_when_an_elastic_job_shares_the_agent_store():
    from moeckpt.trainer.launch import torchrun_env
    from moeckpt.trainer.parallel import shared_store_warning

    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(
        {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    )
    assert shared_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert shared_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}) is None
    # and our launcher opts out, so its workers never see the shared store
    assert torchrun_env(2, base={})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_every_world_an_elastic_job_may_reach_is_checked_before_it_starts(tmp_path, moeckpt_cli):
    from moeckpt.formats.errors import LayoutError
    from moeckpt.trainer.train import TrainConfig, check_launch

    run = str(tmp_path / "run")
    # ep=2 cannot run once the job shrinks to one node of one worker: refused up front, nothing started
    code, _, err = moeckpt_cli(
        "train",
        "--model",
        "zaya-tiny",
        "--run-dir",
        run,
        "--cpu",
        "--ep",
        "2",
        "--nproc",
        "1",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        "127.0.0.1:1",
    )
    assert code == 2 and "ep=2" in err and not os.path.exists(run)
    # --ep auto: the widest expert parallelism each world allows
    auto = TrainConfig(model="zaya-tiny", run_dir=run, ep=None, global_batch=8)
    for world in (1, 2, 4):
        check_launch(auto, world)
    with pytest.raises(LayoutError):
        check_launch(TrainConfig(model="zaya-tiny", run_dir=run, ep=2), 1)
    code, _, err = moeckpt_cli("train", "--model", "zaya-tiny", "--run-dir", run, "--ep", "two")
    assert code == 2 and "auto" in err


def test_the_agents_own_rendezvous_keys_are_taken_out_before_torch_reads_the_rest():
    import argparse

    from moeckpt.trainer import agent

    args = argparse.Namespace(
        rdzv_conf="join_timeout=300,poll_interval=0.1,last_call_timeout=3,restart_last_call_timeout=1"
    )
    assert agent._take_own_keys(args) == {"poll_interval": 0.1, "restart_last_call_timeout": 1.0}
    assert args.rdzv_conf == "join_timeout=300,last_call_timeout=3"
    args = argparse.Namespace(rdzv_conf="")
    assert agent._take_own_keys(args) == {} and args.rdzv_conf == ""
    for bad in ("poll_interval=fast", "poll_interval=0", "restart_last_call_timeout=-1"):
        with pytest.raises(SystemExit, match="--rdzv-conf"):
            agent._take_own_keys(argparse.Namespace(rdzv_conf=bad))


def test_a_round_for_a_joining_node_keeps_the_first_last_call_and_a_restart_after_a_loss_the_short_one():
    """Under load, a joining node missed a survivor's short restart last call and the job restarted once more:
    a round the agent enters because nodes wait to join keeps torch's ``last_call_timeout``."""
    from datetime import timedelta
    from types import SimpleNamespace

    from moeckpt.trainer import agent

    class Handler:  # the two methods of torch's DynamicRendezvousHandler the agent wraps, and its timeout
        def __init__(self) -> None:
            self._settings = SimpleNamespace(timeout=SimpleNamespace(_last_call=timedelta(seconds=10)))
            self.waiting, self.last_calls = 0, []

        def next_rendezvous(self):
            self.last_calls.append(self._settings.timeout._last_call.total_seconds())

        def num_nodes_waiting(self) -> int:
            return self.waiting

    agent._last_call_after_the_first_round(2.0, Handler)
    h = Handler()
    h.next_rendezvous()  # the first round
    h.num_nodes_waiting()
    h.next_rendezvous()  # workers failed (a node lost): no node waited
    h.waiting = 1
    assert h.num_nodes_waiting() == 1
    h.next_rendezvous()  # a node asked to join
    h.waiting = 0
    h.next_rendezvous()  # failed again
    assert h.last_calls == [10.0, 2.0, 10.0, 2.0]


def test_workers_are_forked_from_the_warm_server_unless_a_start_method_or_the_opt_out_is_given(monkeypatch):
    from moeckpt.trainer import agent

    monkeypatch.delenv("MOECKPT_AGENT_FORKSERVER", raising=False)
    monkeypatch.delenv("PET_START_METHOD", raising=False)
    assert agent._warm_workers(["--nproc-per-node=2", "-m", "moeckpt.trainer.launch", "train", "{}"])
    assert not agent._warm_workers(["--start-method=spawn", "-m", "moeckpt.trainer.launch", "train", "{}"])
    assert not agent._warm_workers(["--start_method", "fork", "-m", "moeckpt.trainer.launch", "train", "{}"])
    monkeypatch.setenv("MOECKPT_AGENT_FORKSERVER", "0")
    assert not agent._warm_workers(["-m", "moeckpt.trainer.launch", "train", "{}"])


@pytest.mark.parametrize(
    ("error", "line"),
    [
        ("FileNotFoundError(2, 'No such file or directory')", ""),
        ("EOFError()", ""),
        ("ValueError('bad start')", "moeckpt: a worker could not start: ValueError: bad start\n"),
    ],
)
def test_a_worker_the_warm_server_cannot_start_ends_without_a_traceback(error, line):
    """The fork server's hook (trainer/warm_server.py): a start that fails because the agent is already gone (its
    semaphores and pipes removed by a signal) prints nothing, any other failure one line; never a traceback."""
    import subprocess
    import sys

    code = f"import moeckpt.trainer.warm_server\nraise {error}"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stderr == line, run.stderr
