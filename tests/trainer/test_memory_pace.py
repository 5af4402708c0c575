"""A memory save that cannot start (the previous one still in flight) is counted, logged, and widens the memory
interval, which narrows back once the tier keeps up (:mod:`moeckpt.trainer.memory_pace`)."""

from __future__ import annotations

import logging
import threading

from moeckpt.trainer import memory_tier
from moeckpt.trainer.memory_pace import MemoryPace
from moeckpt.trainer.metrics import read_metrics
from moeckpt.trainer.train import TrainConfig, Trainer

BASE = {"model": "zaya-tiny", "seq_len": 32, "global_batch": 4, "warmup_steps": 2, "cpu": True}


def test_the_interval_doubles_on_a_left_out_save_and_halves_back_after_saves_that_keep_up():
    pace = MemoryPace(every=3)
    assert [s for s in range(1, 13) if pace.due(s)] == [3, 6, 9, 12]
    pace.kept_up(3)
    pace.left_out(6, in_flight=3)
    assert (pace.effective, pace.left, pace.left_steps) == (6, 1, [6])
    pace.left_out(12, in_flight=3)
    assert (pace.effective, pace.widest) == (12, 12)
    pace.kept_up(24)
    assert pace.effective == 12  # one save that keeps up is not yet a trend
    pace.kept_up(36)
    pace.kept_up(42)
    pace.kept_up(48)
    assert pace.effective == 3 and pace.summary()["interval_changes"] == [[6, 6], [12, 12], [36, 6], [48, 3]]
    with_persistent = MemoryPace(every=0)  # memory checkpoints only with persistent saves: counted, no interval
    with_persistent.left_out(10, in_flight=5)
    assert not with_persistent.due(4) and (with_persistent.left, with_persistent.effective) == (1, 0)


def test_a_memory_save_left_out_is_counted_logged_and_the_run_reports_the_interval(tmp_path, monkeypatch, caplog):
    """Every memory save takes two steps to commit (held until the training thread has trained two more steps,
    then joined: no timing involved), against --memory-every 1: the one due meanwhile is left out, the interval
    doubles to 2, and two saves that start with nothing in flight bring it back to 1."""
    cfg = TrainConfig(
        run_dir=str(tmp_path / "run"),
        memory_tier=True,
        memory_dir=str(tmp_path / "shm"),
        memory_every=1,
        steps=8,
        **BASE,
    )
    trainer = Trainer(cfg)
    gates: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def gate(step: int) -> threading.Event:
        with lock:
            return gates.setdefault(step, threading.Event())

    original = memory_tier.MemoryTier.save

    def held_save(self, step, *args, **kwargs):
        gate(step).wait(60)
        return original(self, step, *args, **kwargs)

    def release(upto: int) -> None:
        for step in [s.step for s in trainer.checkpoints.history if not s.skipped and s.step <= upto]:
            if not gate(step).is_set():
                gate(step).set()
                inflight = trainer.checkpoints._memory_inflight
                if inflight is not None and inflight.stats.step == step:
                    inflight.thread.join(60)

    train_step, wait = trainer.train_step, trainer.checkpoints.wait

    def two_steps_later():
        record = train_step()
        release(trainer.step - 2)
        return record

    def wait_all():
        release(10**9)
        return wait()

    monkeypatch.setattr(memory_tier.MemoryTier, "save", held_save)
    monkeypatch.setattr(trainer, "train_step", two_steps_later)
    monkeypatch.setattr(trainer.checkpoints, "wait", wait_all)
    caplog.set_level(logging.INFO, logger="moeckpt")
    try:
        records = trainer.run()
    finally:
        for event in list(gates.values()):
            event.set()
        trainer.close()

    assert [r["step"] for r in records if r.get("memory_skipped")] == [2, 7]
    assert [r["memory_every"] for r in records] == [1, 2, 2, 2, 2, 1, 2, 2]
    committed = [s.step for s in trainer.checkpoints.history if s.memory is not None and s.memory.committed]
    assert committed == [1, 4, 6, 8]
    assert trainer.checkpoints.memory_skipped == 2

    left = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory checkpoint of step")]
    assert len(left) == 2, left
    assert "step 2 left out (1 so far)" in left[0] and "step 1 is still being written" in left[0]
    assert "interval is now 2 steps (was 1, --memory-every 1)" in left[0]
    assert any("keeps up again: the memory interval is now 1 steps" in r.getMessage() for r in caplog.records)

    rows = read_metrics(cfg.run_dir, events=True)
    (pace,) = [r for r in rows if r.get("event") == "memory_pace"]
    assert (pace["memory_every"], pace["effective_every"], pace["widest_every"]) == (1, 2, 2)
    assert (pace["left_out"], pace["left_out_steps"]) == (2, [2, 7])
    assert any("2 memory save(s) left out (steps 2, 7)" in r.getMessage() for r in caplog.records)
    # each save's record says where training waited; a left-out one copied nothing
    saves = {r["step"]: r["save"] for r in records if "save" in r}
    assert saves[2]["skipped"] and saves[2]["bytes"] == 0 and saves[2]["copy_s"] == 0.0
    assert saves[4]["memory"] and saves[4]["bytes"] > 0 and saves[4]["blocked_s"] >= saves[4]["copy_s"]
    commits = [r["step"] for r in rows if r.get("event") == "memory_commit"]
    assert commits == [1, 4, 6, 8]
