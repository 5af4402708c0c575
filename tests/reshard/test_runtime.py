"""reshard.runtime: paused_gc (the collector is off during the pause, and what the pause made leaves it in the
oldest generation (one splice), so the first collection afterwards does not walk millions of young objects), and
the share of the host's cores a rank's thread pools are sized by."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from moeckpt.reshard.runtime import paused_gc


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def clean_gc():
    """Start without frozen objects and leave the collector as it was (other tests share the process)."""
    was_enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.unfreeze()
    gc.enable()
    yield
    if frozen:
        gc.freeze()
    if not was_enabled:
        gc.disable()


def _in_generation(obj: object, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_objects_made_in_a_pause_leave_it_in_the_oldest_generation(clean_gc):
    with paused_gc():
        assert not gc.isenabled()
        made = [_Node() for _ in range(10_000)]
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0  # spliced through the permanent generation and back, nothing left frozen
    assert _in_generation(made[0], 2) and not _in_generation(made[0], 0)
    assert gc.get_count()[0] < 1_000  # the young generation is not left holding what the pause made


def test_a_cycle_made_in_a_pause_is_still_collected(clean_gc):
    with paused_gc():
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
    assert alive() is not None  # a cycle: only the collector frees it
    gc.collect()
    assert alive() is None


def test_a_process_that_froze_objects_keeps_them_frozen(clean_gc):
    kept = _Node()
    gc.freeze()
    with paused_gc():
        made = _Node()
    # In no generation the collector walks, so frozen: ours beside theirs, and theirs not unfrozen.
    assert not any(_in_generation(made, g) for g in range(3))
    assert not any(_in_generation(kept, g) for g in range(3))
    del kept, made


def test_a_nested_pause_keeps_the_collector_off_until_the_outer_one_ends(clean_gc):
    with paused_gc():
        with paused_gc():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_entered_with_the_collector_off_leaves_it_off(clean_gc):
    gc.disable()
    with paused_gc():
        pass
    assert not gc.isenabled()


def test_load_fill_threads_are_the_ranks_share_of_the_hosts_cores(monkeypatch):
    from moeckpt.reshard.options import LOAD_FILL_THREADS_MAX, LOAD_FILL_THREADS_MIN, LoadOptions

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert LoadOptions().fill_threads == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # one core each: still one thread reading while one hashes
    assert LoadOptions().fill_threads == LOAD_FILL_THREADS_MIN
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # one process alone on the host
    assert LoadOptions().fill_threads == LOAD_FILL_THREADS_MAX
    assert LoadOptions(fill_threads=5).fill_threads == 5


def test_offline_writers_default_to_four_or_the_machines_cores_if_fewer(monkeypatch):
    import click
    from click.testing import CliRunner

    from moeckpt.cli.main import all_commands, cli
    from moeckpt.reshard.options import OFFLINE_WORKERS, ReshardOptions

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert ReshardOptions().workers == OFFLINE_WORKERS == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert ReshardOptions().workers == 2
    assert ReshardOptions(workers=6).workers == 6  # asked for: as asked
    # The CLI's --workers default is the same rule, evaluated when the command runs, and says so in --help.
    commands = all_commands()
    for name in ("reshard", "import-dcp", "import-hf", "init"):
        option = next(p for p in commands[name].params if p.name == "workers")
        assert option.get_default(click.Context(commands[name]), call=True) == 2, name
        help_text = " ".join(CliRunner().invoke(cli, [name, "--help"]).output.split())
        assert "[default: (4, or the machine's cores if fewer)]" in help_text, (name, help_text)
