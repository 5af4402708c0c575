"""Any model, without a plan: a ``moeckpt.save`` of DTensors resharded to another mesh by ``moeckpt reshard --mesh``
and consolidated by ``moeckpt consolidate`` into Hugging Face sharded safetensors of full tensors, read back by
the ``safetensors`` library bit for bit, with bounded memory counted (not timed) and every byte verified."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import moeckpt
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.hf_shards import INDEX_FILE
from moeckpt.trainer.local_world import run_local_world

from .. import library_workers as w
from ..helpers import flip_byte, tensors_equal

#: FSDP2-like Shard(0) on mesh dim 0, TP-like Shard(1) on mesh dim 1, uneven sizes, a replicated bias.
SPECS = {
    "wq": ([10, 6], ["S(0)", "S(1)"]),
    "wo": ([6, 9], ["S(1)", "S(0)"]),
    "emb": ([7, 4], ["S(0)", "R"]),
    "bias": ([5], ["R", "S(0)"]),
    "norm": ([3], ["R", "R"]),
}


def _consolidated(out) -> dict[str, torch.Tensor]:
    index = json.load(open(os.path.join(out, INDEX_FILE)))
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        got.update(load_file(os.path.join(out, shard)))
    return got


def _check_index(out, tensors: dict[str, torch.Tensor], max_shard: int) -> None:
    """The index as transformers reads it: every name mapped to the shard that holds it, total_size the bytes."""
    from transformers.utils.hub import get_checkpoint_shard_files

    files, meta = get_checkpoint_shard_files(str(out), os.path.join(out, INDEX_FILE))
    index = json.load(open(os.path.join(out, INDEX_FILE)))
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors) and sorted(meta["all_checkpoint_keys"]) == sorted(tensors)
    assert sorted(map(os.path.basename, files)) == sorted(set(index["weight_map"].values()))
    for path in files:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == os.path.basename(path) for k in keys)
            data = sum(tensors[k].numel() * tensors[k].element_size() for k in keys)
            assert len(keys) == 1 or data <= max_shard, (path, data)


@pytest.mark.slow
def test_a_mesh_saved_model_reshards_to_another_mesh_and_consolidates_bit_for_bit(tmp_path, moeckpt_cli):
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "hf"
    run_local_world(w.save_on_mesh, 4, str(src), (2, 2), SPECS, True, False)
    full = {f"model.{k}": v for k, v in w.full_values({k: s for k, (s, _) in SPECS.items()}).items()}
    full["scalar"] = torch.tensor(3.5)

    code, said, err = moeckpt_cli("reshard", src, dst, "--mesh", "3x2", "--placements", "S(1),S(0)")
    assert code == 0, err
    assert "mesh 3x2 [S(1),S(0)]" in said
    assert moeckpt.verify(str(dst)) == []
    reader = CheckpointReader(str(dst))
    assert [m.shape for m in reader.index.meshes] == [(3, 2)]
    assert reader.index.tensors["model.wq"].sharding["placements"] == ["S(1)", "S(0)"]
    assert reader.index.tensors["model.bias"].sharding["placements"] == ["R", "S(0)"]  # no dim 1: replicated
    assert len(reader.index.files) == 6
    # wq [10, 6] on 3x2 with S(1),S(0): six boxes of 5 rows x 2 columns
    boxes = sorted((r.box.offsets, r.box.shape) for r in reader.pieces() if r.tensor == "model.wq")
    assert boxes == sorted(((r, c), (5, 2)) for r in (0, 5) for c in (0, 2, 4))

    code, said, err = moeckpt_cli("consolidate", dst, out, "--max-shard-size", "200B")
    assert code == 0, err
    got = _consolidated(out)
    assert set(got) == set(full)
    for name, value in full.items():
        assert tensors_equal(got[name], value), name
    _check_index(out, full, 200)
    assert len(os.listdir(out)) > 2  # several shards and the index, nothing else


def test_consolidate_holds_one_run_of_rows_at_a_time_and_verifies_every_byte(tmp_path, moeckpt_cli, monkeypatch):
    """A 2x2 FSDP x TP checkpoint (written by reshard --mesh from a one-process save) consolidated with a 1 KiB
    slab: every run read or assembled is at most a slab (or one row), counted at the reader, never a tensor."""
    state = {
        "w": torch.randn(64, 40),  # 10 KiB, rows of 160 B: runs of 6 rows in each 32-row half, two pieces wide
        "emb": torch.randn(33, 17).to(torch.bfloat16),
        "wide": torch.randn(2, 700, dtype=torch.float64),  # one row is 5.6 KiB: runs of a row
        "ids": torch.arange(9),
        "step": torch.tensor(12),
        "empty": torch.zeros(0, 4),
    }
    saved, mesh, out = tmp_path / "one", tmp_path / "mesh", tmp_path / "hf"
    moeckpt.save({"model": state}, str(saved))
    assert moeckpt_cli("reshard", saved, mesh, "--mesh", "2x2", "--placements", "S(0),S(1)")[0] == 0

    runs, fetched = [], []
    real_box, real_piece = CheckpointReader.read_box, CheckpointReader.read_piece

    def read_box(self, name, box, refs=None):
        runs.append((name, box.numel * torch.tensor([], dtype=state[name.split(".")[1]].dtype).element_size()))
        return real_box(self, name, box, refs)

    def read_piece(self, ref, rows=None):
        data = real_piece(self, ref, rows)
        fetched.append((ref.tensor, data.nbytes))
        return data

    monkeypatch.setattr(CheckpointReader, "read_box", read_box)
    monkeypatch.setattr(CheckpointReader, "read_piece", read_piece)
    result = moeckpt.consolidate(str(mesh), str(out), max_shard_size=4000, slab_bytes=1024)
    row = {n: v[0].numel() * v.element_size() if v.dim() else v.element_size() for n, v in state.items() if v.numel()}
    bound = {f"model.{n}": max(1024, r) for n, r in row.items()}
    assert runs and fetched
    assert all(n <= bound[name] for name, n in runs + fetched), (runs, fetched)
    assert result.peak_slab_bytes <= max(bound.values()) < state["w"].numel() * 4
    assert sum(1 for name, _ in runs if name == "model.w") == 2 * 6  # w assembled run by run, never whole
    got = _consolidated(out)
    for name, value in state.items():
        assert tensors_equal(got[f"model.{name}"], value), name
    _check_index(out, {f"model.{n}": v for n, v in state.items()}, 4000)
    # the same checkpoint in zarr consolidates to the same bytes: the output depends on the logical tensors only
    monkeypatch.undo()
    assert moeckpt_cli("reshard", mesh, tmp_path / "z", "--format", "zarr")[0] == 0
    moeckpt.consolidate(str(tmp_path / "z"), str(tmp_path / "hf-z"), max_shard_size=4000, slab_bytes=1024)
    assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / "hf-z"))
    for name in os.listdir(out):
        assert (out / name).read_bytes() == (tmp_path / "hf-z" / name).read_bytes(), name

    # a flipped byte in any stored piece is found: the run fails naming the file, and leaves nothing at OUT
    reader = CheckpointReader(str(mesh))
    ref = next(r for r in reader.pieces() if r.tensor == "model.w")
    flip_byte(str(mesh), ref.file, ref.start + 5)
    code, _, err = moeckpt_cli("consolidate", mesh, tmp_path / "bad")
    assert code == 2 and ref.file in err and "checksum" in err.lower(), err
    assert not (tmp_path / "bad").exists() and not (tmp_path / ".bad.partial").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--placements", "S(0)"], "--placements needs --mesh"),
        (["--mesh", "2x2", "--dp", "4"], "leave out --tp, --ep and --dp"),
        (["--mesh", "2x2", "--placements", "S(0)"], "one per mesh dimension"),
        (["--mesh", "2by2"], "not a mesh shape"),
        (["--mesh", "0x2"], "not a mesh shape"),
        (["--mesh", "2", "--placements", "SS(0,2)"], "R or S(dim) only"),
    ],
)
def test_mesh_targets_that_cannot_be_written_are_refused_in_one_line(tmp_path, moeckpt_cli, args, message):
    moeckpt.save({"w": torch.ones(4, 4)}, str(tmp_path / "c"))
    code, _, err = moeckpt_cli("reshard", tmp_path / "c", tmp_path / "d", *args)
    assert code == 2 and message in err, err
    assert not (tmp_path / "d").exists()


def test_a_model_checkpoint_takes_its_layout_not_a_mesh_and_consolidates_too(tmp_path, moeckpt_cli):
    ck = tmp_path / "ck"
    assert moeckpt_cli("init", ck, "--model", "zaya-tiny", "--dp", 2)[0] == 0
    code, _, err = moeckpt_cli("reshard", ck, tmp_path / "d", "--mesh", "2")
    assert code == 2 and "--mesh is for state-dict checkpoints" in err
    # export-hf of a state dict without --model points at consolidate
    moeckpt.save({"w": torch.ones(2)}, str(tmp_path / "sd"))
    code, _, err = moeckpt_cli("export-hf", tmp_path / "sd", tmp_path / "x")
    assert code == 2 and "moeckpt consolidate" in err
    code, said, _ = moeckpt_cli("consolidate", ck, tmp_path / "all")
    reader = CheckpointReader(str(ck))
    got = _consolidated(tmp_path / "all")
    assert code == 0 and set(got) == set(reader.index.tensors)
    name = next(iter(reader.index.tensors))
    assert tensors_equal(got[name], reader.read_tensor(name))
