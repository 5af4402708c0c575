"""The library API (``import moeckpt``): save / async_save / load of state dicts of DTensors, tensors and values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import moeckpt
from moeckpt.trainer.local_world import run_local_world

from .. import library_workers as w


def _read(out_dir, world):
    return [json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in range(world)]


# -- one process -------------------------------------------------------------------------------------------------


def _sd():
    return {
        "model": {"layers": [{"w": torch.arange(12.0).reshape(3, 4)}, {"w": torch.ones(2, 2, dtype=torch.bfloat16)}]},
        "step": 5,
        "scalar": torch.tensor(2.5),
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["a", "b"]}]},
        "empty": torch.zeros(0, 3),
    }


def test_a_state_dict_round_trips_in_place(tmp_path):
    sd = _sd()
    moeckpt.save(sd, str(tmp_path / "c"), step=5)
    out = {
        "model": {"layers": [{"w": torch.zeros(3, 4)}, {"w": torch.zeros(2, 2, dtype=torch.bfloat16)}]},
        "step": 0,
        "scalar": torch.tensor(0.0),
        "optim": {"param_groups": [{"lr": 0, "betas": (0, 0), "params": []}]},
        "empty": torch.ones(0, 3),
    }
    values = moeckpt.load(out, str(tmp_path / "c"))
    assert torch.equal(out["model"]["layers"][0]["w"], sd["model"]["layers"][0]["w"])
    assert torch.equal(out["model"]["layers"][1]["w"], sd["model"]["layers"][1]["w"])
    assert float(out["scalar"]) == 2.5 and out["step"] == 5
    # Tuples come back as lists (JSON); DCP's flattened keys name everything.
    assert out["optim"]["param_groups"][0] == {"lr": 0.1, "betas": [0.9, 0.95], "params": ["a", "b"]}
    assert values["optim.param_groups.0.lr"] == 0.1 and values["step"] == 5
    assert moeckpt.verify(str(tmp_path / "c")) == []
    index = json.load(open(tmp_path / "c" / "moeckpt.json"))
    assert index["format_version"] == 2 and "model.layers.0.w" in index["tensors"]


def test_a_state_without_dtensors_saves_without_importing_dtensor(tmp_path):
    """The first save of a fresh process does not pay for importing ``torch.distributed.tensor`` when nothing in
    the state can be a DTensor; a state that has one still saves its shardings (the DTensor tests)."""
    code = (
        "import sys, torch, moeckpt\n"
        f"moeckpt.save({{'w': torch.ones(3), 'step': 1}}, {str(tmp_path / 'c')!r})\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr
    assert moeckpt.verify(tmp_path / "c") == []


def test_paths_may_be_pathlib_paths(tmp_path):
    """``pathlib.Path`` works wherever a path string does, as in ``torch.distributed.checkpoint``."""
    sd = {"w": torch.arange(6.0).reshape(2, 3), "step": 1}
    moeckpt.save(sd, tmp_path / "sync")
    moeckpt.async_save(sd, tmp_path / "async", format="zarr").wait()
    for where in ("sync", "async"):
        out = {"w": torch.zeros(2, 3), "step": 0}
        moeckpt.load(out, tmp_path / where)
        assert torch.equal(out["w"], sd["w"]) and out["step"] == 1
        assert moeckpt.verify(tmp_path / where) == []
        assert moeckpt.CheckpointReader(tmp_path / where).index.tensors.keys() == {"w"}
    ckpt = moeckpt.Checkpointer(tmp_path / "run", async_save=False)
    ckpt.save(3, sd)
    assert ckpt.run_dir == str(tmp_path / "run") and os.path.isdir(ckpt.step_path(3))


class NotJson:
    pass


@pytest.mark.parametrize(
    "leaf, message",
    [
        (NotJson(), "type NotJson cannot be saved"),
        ({1, 2}, "type set cannot be saved"),
        (torch.zeros(2).to_sparse(), "sparse"),
        (b"bytes", "type bytes cannot be saved"),
    ],
)
def test_leaves_that_are_not_tensors_or_json_are_refused_naming_the_key(tmp_path, leaf, message):
    with pytest.raises(moeckpt.StateDictError, match=message) as e:
        moeckpt.save({"ok": torch.zeros(1), "bad": {"leaf": leaf}}, str(tmp_path / "c"))
    assert "'bad.leaf'" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("key", ["..", "a/../b", "/abs", "back\\slash", "ctl\x07", "a//b"])
def test_keys_that_are_not_safe_tensor_names_are_refused(tmp_path, key):
    with pytest.raises(moeckpt.UnsafePathError):
        moeckpt.save({key: torch.zeros(1)}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_a_mismatching_state_dict_loads_nothing_and_names_the_key(tmp_path):
    moeckpt.save({"a": torch.ones(2), "b": torch.ones(3)}, str(tmp_path / "c"))
    a, b = torch.zeros(2), torch.zeros(4)
    with pytest.raises(moeckpt.StateDictError, match=r"'b' is \[3\] float32 in the checkpoint, \[4\] float32"):
        moeckpt.load({"a": a, "b": b}, str(tmp_path / "c"))
    assert not a.any(), "nothing may be loaded half-way"
    with pytest.raises(moeckpt.StateDictError, match="no tensor 'c'"):
        moeckpt.load({"a": a, "c": torch.zeros(1)}, str(tmp_path / "c"))
    with pytest.raises(moeckpt.StateDictError, match="float32 in the checkpoint, \\[2\\] bfloat16"):
        moeckpt.load({"a": torch.zeros(2, dtype=torch.bfloat16)}, str(tmp_path / "c"))
    assert not a.any()


def test_a_subset_of_the_checkpoint_loads(tmp_path):
    moeckpt.save({"a": torch.ones(2), "b": torch.ones(3)}, str(tmp_path / "c"))
    b = torch.zeros(3)
    moeckpt.load({"b": b}, str(tmp_path / "c"))
    assert b.eq(1).all()


def test_async_save_returns_before_the_commit_and_reuses_its_buffers(tmp_path):
    t = torch.arange(1_000_000, dtype=torch.float32)
    h = moeckpt.async_save({"t": t}, str(tmp_path / "a"))
    t.add_(1)  # the snapshot was taken: changing the tensor now does not change the checkpoint
    h.wait()
    assert h.done()
    out = {"t": torch.zeros_like(t)}
    moeckpt.load(out, str(tmp_path / "a"))
    assert torch.equal(out["t"], torch.arange(1_000_000, dtype=torch.float32))
    h2 = moeckpt.async_save({"t": t}, str(tmp_path / "b"))
    h2.wait()
    moeckpt.load(out, str(tmp_path / "b"))
    assert torch.equal(out["t"], t)


def test_save_refuses_a_non_empty_destination_unless_overwrite(tmp_path):
    moeckpt.save({"a": torch.ones(1)}, str(tmp_path / "c"))
    with pytest.raises(moeckpt.DestinationNotEmptyError):
        moeckpt.save({"a": torch.ones(1)}, str(tmp_path / "c"))
    moeckpt.save({"a": torch.full((1,), 2.0)}, str(tmp_path / "c"), overwrite=True)
    out = {"a": torch.zeros(1)}
    moeckpt.load(out, str(tmp_path / "c"))
    assert float(out["a"]) == 2.0


def test_checkpointer_keeps_the_newest_and_skips_a_damaged_one(tmp_path):
    from ..helpers import flip_byte

    run = str(tmp_path / "run")
    with moeckpt.Checkpointer(run, keep_last=2) as ckpt:
        assert ckpt.load_latest({"w": torch.zeros(3)}) is None
        for step in (10, 20, 30):
            ckpt.save(step, {"w": torch.full((3,), float(step)), "step": step})
        ckpt.wait()
        assert ckpt.steps() == [20, 30]
        flip_byte(os.path.join(run, "step-00000030"), "rank-00000.safetensors", -3)
        out = {"w": torch.zeros(3), "step": 0}
        assert ckpt.load_latest(out) == 20
        assert out["step"] == 20 and out["w"].eq(20).all()
        assert any(n.startswith("damaged-step-00000030") for n in os.listdir(run))


# -- several processes -------------------------------------------------------------------------------------------

SPECS_A = {  # saved on a 2 x 2 mesh
    "w_rows": ([6, 8], ["SS(0,2)", "S(0)"]),  # FSDP2 + TP, uneven
    "w_cols": ([8, 6], ["S(0)", "S(1)"]),
    "bias": ([8], ["S(0)", "R"]),
    "repl": ([5, 3], ["R", "R"]),
    "odd": ([7, 5], ["S(1)", "S(0)"]),
}
SPECS_B = {  # loaded on 2 ranks, other placements
    "w_rows": ([6, 8], ["S(1)"]),
    "w_cols": ([8, 6], ["S(0)"]),
    "bias": ([8], ["R"]),
    "repl": ([5, 3], ["S(0)"]),
    "odd": ([7, 5], ["R"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_dtensors_saved_on_one_mesh_load_on_another(tmp_path, use_async):
    path = str(tmp_path / "c")
    run_local_world(w.save_on_mesh, 4, path, (2, 2), SPECS_A, True, use_async)
    assert moeckpt.verify(path) == []
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_local_world(w.load_on_mesh, 2, path, (2,), SPECS_B, out)
    for report in _read(out, 2):
        assert all(report["ok"].values()), report["ok"]
        assert report["step"] == 7 and report["scalar"] == 3.5 and report["lr"] == 0.01
        # each rank reads the bytes it needs, not the checkpoint
        assert report["bytes_read"] <= 1.05 * report["bytes_needed"] + 8 * 4096
    # one process, world size 1
    run_local_world(w.load_on_mesh, 1, path, (1,), {k: (s, ["R"]) for k, (s, _) in SPECS_A.items()}, out)
    assert all(_read(out, 1)[0]["ok"].values())


@pytest.mark.slow
def test_fsdp2_tp_training_resumes_on_another_mesh(tmp_path):
    out = str(tmp_path)
    path = str(tmp_path / "ckpt")
    run_local_world(w.fsdp_train, 4, 2, 2, out, path, "save")
    run_local_world(w.fsdp_train, 4, 2, 2, out, path, "resume")
    straight = json.load(open(tmp_path / "save-2x2.json"))  # steps 0-5, saved after step 2
    resumed = json.load(open(tmp_path / "resume-2x2.json"))
    assert resumed == straight[3:], "the same mesh resumes bit for bit"
    run_local_world(w.fsdp_train, 2, 2, 1, out, path, "resume")
    other = json.load(open(tmp_path / "resume-2x1.json"))
    assert other == pytest.approx(straight[3:], rel=1e-5)


def test_repeated_saves_hold_what_each_saved_and_disagreeing_ranks_fail_together(tmp_path):
    """Saves of one structure reuse its plan (only the values change) and the checkpoint still holds each save's
    values and tensors; a new structure gets a new plan; ranks disagreeing on a key fail the save on every rank."""
    from moeckpt.formats.checkpoint import CheckpointReader

    root, out = tmp_path / "ck", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    run_local_world(w.repeated_saves, 2, str(root), str(out))
    for step in (1, 2):
        index = CheckpointReader(str(root / f"a{step}")).index
        assert index.step == step
        assert index.train_state == {"opt.lr": 0.1 * step, "step": step}
        sd = {"w": torch.zeros(4, 2), "d": torch.zeros(4, 2)}
        moeckpt.load(sd, str(root / f"a{step}"))
        assert torch.equal(sd["w"], torch.arange(8, dtype=torch.float32).reshape(4, 2) * step)
        assert torch.equal(sd["d"], torch.arange(8, dtype=torch.float32).reshape(4, 2) * 10 * step)
    index = CheckpointReader(str(root / "b")).index
    assert sorted(index.tensors) == ["b", "w"] and index.train_state == {"step": 3}
    for rank in (0, 1):
        results = json.loads((out / f"rank{rank}.json").read_text())
        for name, key in (("value", "step"), ("kind", "x")):
            assert results[name] is not None and results[name][0] == "StateDictError", results
            assert repr(key) in results[name][1] and "differs between ranks" in results[name][1], results
            assert not (root / f"bad-{name}" / "moeckpt.json").exists()


def test_load_reads_whole_boxes_in_place_and_still_verifies_every_block(tmp_path):
    """A plain tensor's box is read straight into the caller's tensor (no copy through a buffer) and a flipped
    byte inside it is still caught by its block checksum, naming the tensor; nothing else is needed to detect it."""
    from moeckpt.formats.checkpoint import CheckpointReader
    from moeckpt.formats.errors import ChecksumMismatchError

    from ..helpers import flip_byte

    path = str(tmp_path / "ck")
    w = torch.randn(512, 256)
    moeckpt.save({"w": w, "b": torch.ones(3)}, path)
    dest = torch.zeros(512, 256)
    address = dest.data_ptr()
    moeckpt.load({"w": dest, "b": torch.zeros(3)}, path)
    assert torch.equal(dest, w) and dest.data_ptr() == address
    ref = next(p for p in CheckpointReader(path).pieces() if p.tensor == "w")
    flip_byte(path, ref.file, ref.start + ref.nbytes // 2)
    with pytest.raises(ChecksumMismatchError, match="'w'"):
        moeckpt.load({"w": torch.zeros(512, 256), "b": torch.zeros(3)}, path)


def test_a_load_into_device_tensors_fills_them_in_place_through_staging(tmp_path, monkeypatch):
    """What a state-dict load into GPU tensors does, on the CPU: views go through the staged paths (whole rows,
    small pieces in runs) and are filled in place, every byte verified."""
    from moeckpt.reshard import staging

    monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    path = str(tmp_path / "ck")
    sd = {"w": torch.randn(512, 256), "b": torch.randn(3), "n": torch.randn(7, dtype=torch.float64)}
    moeckpt.save(sd, path)
    out = {"w": torch.zeros(512, 256), "b": torch.zeros(3), "n": torch.zeros(7, dtype=torch.float64)}
    addresses = {k: v.data_ptr() for k, v in out.items()}
    moeckpt.load(out, path)
    assert all(out[k].data_ptr() == addresses[k] for k in out)
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert torch.equal(out["n"], sd["n"])
