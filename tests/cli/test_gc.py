"""Retention and leftovers: `moeckpt gc` on local and memory:// run directories."""

from __future__ import annotations

import pytest

from moeckpt.formats.checkpoint import begin_save, committed_steps, step_dir_name
from moeckpt.formats.retention import RetentionError, RetentionPolicy
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout

from ..helpers import save_toy


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return f"memory://gc-tests/{tmp_path.name}/run"


def test_gc_keeps_last_and_every_and_removes_leftovers(run_dir, moeckpt_cli):
    for step in (10, 20, 30, 40, 50):
        save_toy(f"{run_dir}/{step_dir_name(step)}", Layout())
    begin_save(f"{run_dir}/{step_dir_name(60)}").write_bytes("rank-00000.safetensors", b"torn")
    code, out, _ = moeckpt_cli("gc", run_dir, "--keep-last", "2", "--keep-every", "20")
    assert code == 0, out
    assert [s for s, _ in committed_steps(run_dir)] == [20, 40, 50]
    names = open_storage(run_dir).listdir()
    assert not any("partial" in n or n == step_dir_name(60) for n in names), names
    assert "removed" in out and "uncommitted leftover" in out


def test_gc_dry_run_changes_nothing(run_dir, moeckpt_cli):
    for step in (1, 2, 3):
        save_toy(f"{run_dir}/{step_dir_name(step)}", Layout())
    code, out, _ = moeckpt_cli("gc", run_dir, "--keep-last", "1", "--dry-run")
    assert code == 0 and "would remove step-00000001" in out
    assert len(committed_steps(run_dir)) == 3


def test_policy_never_removes_the_newest():
    with pytest.raises(RetentionError):
        RetentionPolicy(keep_last=0)
