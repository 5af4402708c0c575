"""The in-memory checkpoint tier (--memory-tier): its commit rule, budget, cleanup, and the resume from it."""

from __future__ import annotations

import os
import shutil

import pytest

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps, verify
from moeckpt.trainer import memory_tier
from moeckpt.trainer.local_world import run_local_world
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.train import TrainConfig, train
from tests.train_workers import memory_run, slow_persist_run, train_on_nodes, train_runs

BASE = {"model": "zaya-tiny", "steps": 6, "seq_len": 32, "global_batch": 4, "warmup_steps": 2, "cpu": True}


def _config(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(
        run_dir=str(tmp_path / "run"), memory_tier=True, memory_dir=str(tmp_path / "shm"), **{**BASE, **kw}
    )


def _root(tmp_path) -> str:
    rid = memory_tier.run_id(str(tmp_path / "run"), create=False)
    assert rid is not None
    return memory_tier.run_root(str(tmp_path / "shm"), rid)


def _node_dir(tmp_path, node: str | None = None) -> str:
    return os.path.join(_root(tmp_path), node or memory_tier.node_name())


def _resume_event(run_dir) -> dict:
    return [r for r in read_metrics(str(run_dir), events=True) if r.get("event") == "resume"][-1]


def test_two_workers_commit_memory_checkpoints_keep_the_newest_and_resume_resharded_on_one(tmp_path):
    cfg = _config(tmp_path, memory_keep=2)
    run_local_world(memory_run, 2, cfg.to_json(), 4, (2,), (2, 3, 4), timeout_s=180)
    node = _node_dir(tmp_path)
    assert sorted(os.listdir(node)) == ["step-00000003", "step-00000004"]  # keep 2, nothing staged left
    reader = CheckpointReader(os.path.join(node, "step-00000004"))
    assert sorted(reader.index.files) == ["rank-00000.safetensors", "rank-00001.safetensors"]
    assert reader.index.layout["dp"] == 2 and reader.index.train_state["step"] == 4
    assert verify(reader) == []
    assert [s for s, _ in committed_steps(str(tmp_path / "run"))] == [2]  # memory checkpoints are not persisted ones

    records = train(cfg)  # one worker: dp 2 -> 1, from memory (step 4), not from disk (step 2)
    assert [r["step"] for r in records] == [5, 6]
    event = _resume_event(tmp_path / "run")
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 4, 0)
    assert event["memory_bytes_read"] > 0 and event["from_layout"]["dp"] == 2 and event["to_layout"]["dp"] == 1
    assert not os.path.exists(_root(tmp_path))  # a normal end removes the run's memory checkpoints


def test_memory_resume_in_the_same_layout_is_bit_exact(tmp_path):
    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 3, (1,), (3,))  # "crashes" after step 3: disk has step 1, memory step 3
    straight = train(TrainConfig(run_dir=str(tmp_path / "straight"), **BASE))  # after: memory_run sets 1 thread
    resumed = train(cfg)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert _resume_event(tmp_path / "run")["tier"] == "memory"


def test_a_newer_persisted_step_wins_over_an_older_memory_one(tmp_path):
    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 3, (3,), (2,))
    train(cfg)
    event = _resume_event(tmp_path / "run")
    assert (event["tier"], event["step"], event["memory_bytes_read"]) == ("storage", 3, 0)


def test_torn_incomplete_and_other_runs_memory_checkpoints_are_ignored(tmp_path):
    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 4, (1,), (2, 3))
    node = _node_dir(tmp_path)
    # torn: a save killed before its commit leaves a staging directory, never a committed step
    shutil.copytree(os.path.join(node, "step-00000003"), os.path.join(node, ".step-00000004.partial"))
    os.remove(os.path.join(node, ".step-00000004.partial", "moeckpt.json"))
    # incomplete: step 3's file is gone (its node lost it): not a complete set, so step 2 is taken
    os.remove(os.path.join(node, "step-00000003", "rank-00000.safetensors"))
    # another run's (or a stale) memory directory with a newer complete step
    other = os.path.join(str(tmp_path / "shm"), "moeckpt-0123456789abcdef", memory_tier.node_name())
    shutil.copytree(os.path.join(node, "step-00000002"), os.path.join(other, "step-00000009"))
    records = train(cfg)
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    event = _resume_event(tmp_path / "run")
    assert (event["tier"], event["step"]) == ("memory", 2)
    assert os.path.isdir(other)  # not ours to remove


def test_a_recreated_run_directory_ignores_the_old_runs_memory(tmp_path):
    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 2, (), (2,))
    old = _root(tmp_path)
    shutil.rmtree(tmp_path / "run")  # a new run under the same name gets a new run id
    records = train(cfg)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert os.path.isdir(old) and _root(tmp_path) != old


def test_memory_every_k_steps_between_persistent_saves(tmp_path):
    cfg = _config(tmp_path, save_every=4, memory_every=1, memory_keep=3, async_save=False)  # none in flight
    memory_run(0, cfg.to_json(), 0, (), ())  # creates the run id
    from moeckpt.trainer.train import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.config = TrainConfig.from_json({**cfg.to_json(), "stop_at": 5})
        trainer.run()
        kinds = [
            (s.step, s.persisted, s.memory is not None and s.memory.committed) for s in trainer.checkpoints.history
        ]
    finally:
        trainer.close()
    assert kinds == [(1, False, True), (2, False, True), (3, False, True), (4, True, True), (5, True, True)]
    assert sorted(os.listdir(_node_dir(tmp_path))) == ["step-00000003", "step-00000004", "step-00000005"]


def test_a_budget_the_filesystem_cannot_hold_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(memory_tier, "_free_bytes", lambda path: 1000)
    with pytest.raises(memory_tier.MemoryBudgetError, match="--memory-keep 2: 2 memory checkpoint"):
        train(_config(tmp_path))


def test_gc_removes_the_runs_memory_checkpoints_and_keeps_counting_only_persisted_ones(tmp_path, moeckpt_cli):
    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 3, (1,), (2, 3))
    root = _root(tmp_path)
    code, out, err = moeckpt_cli("gc", str(tmp_path / "run"), "--memory-dir", str(tmp_path / "shm"))
    assert code == 0, err
    assert f"removed {root} (this host's memory-tier checkpoints of the run)" in out
    assert "kept 1 checkpoint(s): step-00000001" in out
    assert not os.path.exists(root)


def test_memory_options_need_the_tier():
    with pytest.raises(ValueError, match="memory_every=2 needs memory_tier"):
        TrainConfig(run_dir="x", memory_every=2, **BASE)


def test_each_node_holds_its_buddys_part_and_a_lost_node_costs_no_step(tmp_path):
    """Two simulated nodes of one rank each: every node's directory holds both files (its own and its buddy's);
    node n1 lost with its memory, n0 resumes alone from memory; then a new node n2 with nothing joins n0 and reads
    n0's files through the exchange (it gets the step's index only)."""
    cfg = _config(tmp_path)
    run_local_world(memory_run, 2, cfg.to_json(), 3, (1,), (2, 3), "n{rank}", timeout_s=180)
    for node in ("n0", "n1"):
        step = os.path.join(_node_dir(tmp_path, node), "step-00000003")
        assert sorted(n for n in os.listdir(step) if n.endswith(".safetensors")) == [
            "rank-00000.safetensors",
            "rank-00001.safetensors",
        ]
    shutil.rmtree(_node_dir(tmp_path, "n1"))  # the node is lost, and its RAM with it
    run_local_world(memory_run, 1, cfg.to_json(), 1, (), (4,), "n0", timeout_s=180)
    event = _resume_event(tmp_path / "run")
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 3, 0)
    assert (event["from_layout"]["dp"], event["to_layout"]["dp"]) == (2, 1)
    # n0 committed step 4 alone; n2 joins with nothing: both resume step 4, n2's part read on n0
    run_local_world(train_on_nodes, 2, cfg.to_json(), ("n0", "n2"), timeout_s=180)
    event = _resume_event(tmp_path / "run")
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 4, 0)
    assert (event["from_layout"]["dp"], event["to_layout"]["dp"]) == (1, 2)
    resumed = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / "run"))}
    # the same run without a failure, on 2 workers throughout: the pieces read on n0 for n2 were the right ones
    straight = TrainConfig(run_dir=str(tmp_path / "straight"), **BASE)
    run_local_world(train_runs, 2, [straight.to_json()], timeout_s=180)
    expected = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / "straight"))}
    assert sorted(resumed)[-2:] == [5, 6]
    for step in (5, 6):
        assert resumed[step] == pytest.approx(expected[step], abs=1e-4), (step, resumed, expected)


@pytest.mark.slow
def test_the_elastic_drill_with_the_memory_tier_resumes_from_memory_past_the_persisted_step(tmp_path):
    """2 nodes x 2 workers with a memory checkpoint every step; node B killed (its memory directory deleted)
    between two persistent saves: the survivors resume from node A's memory, resharded dp 4 -> 2, reading nothing
    from storage, then grow back to 4 with node C, which holds nothing and reads through the exchange."""
    from moeckpt.trainer.elastic_drill import cpu_drill_args, run_shrink_grow_drill

    run, memory = str(tmp_path / "run"), str(tmp_path / "memory")
    result = run_shrink_grow_drill(
        run, cpu_drill_args(run), nproc=2, kill_at_step=17, timeout_s=600, memory_root=memory
    )
    logs = "\n".join(f"--- node {n}\n{text[-4000:]}" for n, text in result.logs.items())
    assert result.exit_codes == {"A": 0, "C": 0}, logs
    assert [w for _, w in result.worlds()] == [4, 2, 4], (result.worlds(), logs)
    resumes = [e for e in result.events() if e.get("event") == "resume"]
    assert [(r["tier"], r["from_layout"]["dp"], r["to_layout"]["dp"]) for r in resumes] == [
        ("memory", 4, 2),
        ("memory", 2, 4),
    ], (resumes, logs)
    shrink = resumes[0]
    # B is killed as soon as step 17 shows in the metrics: step 17's memory checkpoint may still be in flight, so
    # the newest complete one is 17 or 16, past the persisted 15
    assert shrink["storage_bytes_read"] == 0 and shrink["step"] >= 16, shrink
    assert result.steps_lost() is not None and result.steps_lost() <= 2, (result.steps_lost(), result.timeline)
    assert committed_steps(run)[-1][0] == 80
    assert not any(os.listdir(os.path.join(memory, n)) for n in os.listdir(memory))  # removed at the normal end


def test_a_start_logs_its_phases_after_the_first_step(tmp_path):
    from moeckpt.trainer.phases import PHASES

    cfg = _config(tmp_path)
    memory_run(0, cfg.to_json(), 2, (), (2,))
    train(cfg)
    (event,) = [r for r in read_metrics(str(tmp_path / "run"), events=True) if r.get("event") == "restart_phases"]
    assert (event["tier"], event["step"]) == ("memory", 3)
    marks = [event["marks"][name] for name in PHASES]
    assert all(m is not None for m in marks) and marks == sorted(marks), event
    assert set(event["seconds"]) == set(PHASES[1:]) and all(v >= 0 for v in event["seconds"].values())


def test_the_agent_records_failures_and_restarts_where_asked(tmp_path, monkeypatch):
    import json
    import logging

    from moeckpt.trainer.agent import _FAILED, _AgentLines

    path = tmp_path / "agent.jsonl"
    monkeypatch.setenv("MOECKPT_AGENT_EVENTS", str(path))
    record = logging.LogRecord("torch.distributed", logging.INFO, "", 0, _FAILED, (-9, 0, 1234, "python"), None)
    _AgentLines(verbose=False).emit(record)
    (line,) = path.read_text().splitlines()
    assert json.loads(line)["what"] == "worker_failed" and json.loads(line)["time"] == record.created


def test_the_cli_refuses_a_budget_before_any_worker_starts(tmp_path, moeckpt_cli, monkeypatch):
    monkeypatch.setattr(memory_tier, "_free_bytes", lambda path: 1000)
    code, out, err = moeckpt_cli(
        "train",
        "--model",
        "zaya-tiny",
        "--run-dir",
        str(tmp_path / "run"),
        "--cpu",
        "--steps",
        "2",
        "--memory-tier",
        "--memory-dir",
        str(tmp_path),
        "--memory-keep",
        "4",
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "--memory-keep 4: 4 memory checkpoint(s) need" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_a_run_on_s3_in_zarr_resumes_from_memory_without_reading_the_bucket(tmp_path, s3_url):
    """The run directory on S3 (moto) and in zarr; the memory tier is node-local safetensors all the same."""
    cfg = TrainConfig(run_dir=s3_url, memory_tier=True, memory_dir=str(tmp_path / "shm"), format="zarr", **BASE)
    memory_run(0, cfg.to_json(), 3, (1,), (3,))
    records = train(cfg)
    assert [r["step"] for r in records] == [4, 5, 6]
    event = _resume_event(s3_url)
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 3, 0)
    assert [s for s, _ in committed_steps(s3_url)] == [1, 6]


def test_a_memory_only_save_due_while_a_save_is_in_flight_is_left_out_not_waited_for(tmp_path, monkeypatch):
    import threading
    import time

    from moeckpt.trainer.train import Trainer

    cfg = _config(tmp_path, memory_every=1)
    trainer = Trainer(cfg)
    release = threading.Event()
    original = memory_tier.MemoryTier.save

    def slow_save(self, *args, **kwargs):
        release.wait(30)  # a large state still being written
        return original(self, *args, **kwargs)

    monkeypatch.setattr(memory_tier.MemoryTier, "save", slow_save)
    try:
        trainer.train_step()
        trainer.save(persist=False, memory=True)
        trainer.train_step()
        t0 = time.perf_counter()
        blocked = trainer.save(persist=False, memory=True)
        assert trainer.last_save.skipped and blocked == 0.0 and time.perf_counter() - t0 < 1.0
        release.set()
        trainer.checkpoints.wait()
        trainer.train_step()
        trainer.save(persist=False, memory=True)  # nothing in flight now: written
        trainer.checkpoints.wait()
    finally:
        release.set()
        trainer.close()
    done = [(s.step, s.skipped, s.memory is not None and s.memory.committed) for s in trainer.checkpoints.history]
    assert done == [(1, False, True), (2, True, False), (3, False, True)]


def test_a_persistent_save_due_while_a_memory_write_is_in_flight_is_not_held_back(tmp_path, monkeypatch):
    """A memory write slower than the steps (a large state on one node) must not delay the persistent save that
    comes due meanwhile: that save commits to the run directory alone, without its memory part, while the memory
    write is still in flight."""
    import threading

    from moeckpt.trainer.train import Trainer

    cfg = _config(tmp_path, memory_every=1)
    trainer = Trainer(cfg)
    release = threading.Event()
    original = memory_tier.MemoryTier.save

    def slow_save(self, *args, **kwargs):
        release.wait(60)  # a large state still being written into memory
        return original(self, *args, **kwargs)

    monkeypatch.setattr(memory_tier.MemoryTier, "save", slow_save)
    try:
        trainer.train_step()
        trainer.save(persist=False, memory=True)  # its memory write now hangs until released
        trainer.train_step()
        trainer.save(persist=True, memory=True)
        persisted = threading.Thread(target=trainer.checkpoints._wait_persistent)
        persisted.start()
        persisted.join(20)
        assert not persisted.is_alive(), "the persistent save waited for the memory write"
        assert [s for s, _ in committed_steps(cfg.run_dir)] == [2]
        assert trainer.last_save.persisted and trainer.last_save.memory is None
    finally:
        release.set()
        trainer.close()
    first = trainer.checkpoints.history[0]
    assert first.step == 1 and first.memory is not None and first.memory.committed


def test_memory_checkpoints_land_every_step_while_a_slow_persistent_save_is_written(tmp_path, monkeypatch):
    """A persistent save that takes longer than several steps (every file written to slow:// sleeps 2 s, a step
    takes 0.2 s) does not hold the memory tier back: each step's memory checkpoint is taken from its own snapshot
    and committed beside it, so a kill while that save is still being written loses at most the memory interval
    (1 step)."""
    import json

    import moeckpt.testing.slow  # noqa: F401 - registers slow:// here too, for the resume below
    from moeckpt.trainer.train import Trainer

    monkeypatch.setenv("MOECKPT_SLOW_WRITE_S", "2")
    run_dir = f"slow://{tmp_path / 'run'}"
    cfg = TrainConfig(
        run_dir=run_dir,
        memory_tier=True,
        memory_dir=str(tmp_path / "shm"),
        memory_every=1,
        memory_keep=3,
        **{**BASE, "steps": 20},
    )
    kill_at, out = 10, str(tmp_path / "at-kill.json")
    run_local_world(slow_persist_run, 2, cfg.to_json(), (3,), kill_at, 0.2, out, timeout_s=240)
    with open(out) as f:
        at_kill = json.load(f)
    # the persistent save of step 3 was still being written when step 10 was done, and it is the only one started
    assert at_kill["persisting"] and at_kill["persisted"] == [] and min(at_kill["persist_s"]) > 2
    saves = at_kill["history"]
    assert [(s["step"], s["persisted"]) for s in saves] == [(n, n == 3) for n in range(1, kill_at + 1)]
    assert not any(s["skipped"] for s in saves), saves
    # a memory-only save blocked training for its snapshot only, never for the persistent write (seconds)
    assert max(s["blocked_s"] for s in saves if not s["persisted"]) < 0.5, saves
    newest = max(at_kill["memory_steps"])
    assert newest >= kill_at - cfg.memory_every, at_kill
    # What the kill leaves: the memory checkpoints committed then, and no persisted step (step 3 committed later).
    node = _node_dir(tmp_path)
    for name in os.listdir(node):
        if name.startswith("step-") and int(name.split("-")[1]) > newest:
            shutil.rmtree(os.path.join(node, name))
    for step, _ in committed_steps(run_dir):
        shutil.rmtree(os.path.join(str(tmp_path / "run"), f"step-{step:08d}"))
    trainer = Trainer(cfg)  # one rank now: dp 2 -> 1
    try:
        assert (trainer.resume_tier, trainer.step) == ("memory", newest)
    finally:
        trainer.close()
    assert kill_at - newest <= cfg.memory_every


def _damage(path: str) -> None:
    """Flip a byte in every 4 KiB of a safetensors file's data (whatever a rank reads of it, it reads damage)."""
    import struct

    with open(path, "r+b") as f:
        (header,) = struct.unpack("<Q", f.read(8))
        size = os.path.getsize(path)
        for offset in range(8 + header, size, 4096):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))


def _step_file(tmp_path, node: str, step: int, writer: int = 0) -> str:
    return os.path.join(_node_dir(tmp_path, node), f"step-{step:08d}", f"rank-{writer:05d}.safetensors")


@pytest.mark.slow
def test_a_damaged_memory_copy_falls_back_to_the_replica_then_an_older_memory_step_then_storage(tmp_path):
    """Two simulated nodes of one rank each, every file held by both (one replica). A damaged copy on one node is
    moved aside and the same step read from the other node's replica; with no intact copy of the step left, the
    newest older complete memory step (newer than the persisted one) is taken, and that step retrained saves into
    the memory tier again; with no intact memory step at all, storage."""
    cfg = _config(tmp_path)
    run_dir = str(tmp_path / "run")
    run_local_world(memory_run, 2, cfg.to_json(), 3, (1,), (2, 3), "n{rank}", timeout_s=180)

    def damaged_events() -> list[dict]:
        return [r for r in read_metrics(run_dir, events=True) if r.get("event") == "damaged_checkpoint"]

    # 1. n0's copy of step 3 is damaged: step 3 from n1's replica, n0's copy set aside
    _damage(_step_file(tmp_path, "n0", 3))
    run_local_world(memory_run, 2, cfg.to_json(), 0, (), (), "n{rank}", timeout_s=180)
    event = _resume_event(run_dir)
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 3, 0), event
    assert [(e["tier"], e["step"], sorted(e["nodes"])) for e in damaged_events()] == [("memory", 3, ["n0"])]
    n0 = os.listdir(_node_dir(tmp_path, "n0"))
    assert any(n.startswith(".rejected-step-00000003-") for n in n0), n0
    # what n0 holds of step 3 now is the index it was given to plan the load with, no data
    assert os.listdir(os.path.join(_node_dir(tmp_path, "n0"), "step-00000003")) == ["moeckpt.json"]

    # 2. n1's copy (the only one left) is damaged too: memory step 2, the newest complete one (persisted: 1); the
    # retrained step 3 is saved into the memory tier again on both nodes
    _damage(_step_file(tmp_path, "n1", 3))
    run_local_world(memory_run, 2, cfg.to_json(), 1, (), (3,), "n{rank}", timeout_s=180)
    event = [r for r in read_metrics(run_dir, events=True) if r.get("event") == "resume"][-1]
    assert (event["tier"], event["step"], event["storage_bytes_read"]) == ("memory", 2, 0), event
    assert [(e["step"], sorted(e["nodes"])) for e in damaged_events()][1:] == [(3, ["n1"])]
    for node in ("n0", "n1"):
        step3 = os.path.join(_node_dir(tmp_path, node), "step-00000003")
        assert verify(CheckpointReader(step3)) == [], node  # committed again, intact

    # 3. every memory copy damaged: storage (step 1)
    for node in ("n0", "n1"):
        for step in (2, 3):
            for writer in (0, 1):
                _damage(_step_file(tmp_path, node, step, writer))
    run_local_world(memory_run, 2, cfg.to_json(), 0, (), (), "n{rank}", timeout_s=180)
    event = _resume_event(run_dir)
    assert (event["tier"], event["step"], event["memory_bytes_read"]) == ("storage", 1, 0), event
    assert {e["step"] for e in damaged_events()[2:]} == {3, 2}
