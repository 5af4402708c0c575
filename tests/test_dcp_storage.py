"""``moeckpt.dcp``: torch DCP's save and load through the moeckpt format, and DCP's resharding patterns through it."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moeckpt
import moeckpt.dcp
from moeckpt.trainer.local_world import run_local_world

from . import library_workers as w


def test_dcp_save_writes_a_committed_moeckpt_checkpoint_and_dcp_load_reads_it(tmp_path):
    path = str(tmp_path / "c")
    sd = {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
        "step": 3,
        "optim": {"param_groups": [{"lr": 0.5, "params": ["w"]}]},
    }
    dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path))
    assert moeckpt.verify(path) == []
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    assert index["tensors"]["model.w"]["sharding"] == {"pieces": "stored"}
    assert index["train_state"]["step"] == 3
    assert not any(n.endswith((".metadata", ".distcp")) for n in os.listdir(path)), "no pickle on disk"
    out = {
        "model": {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)},
        "step": 0,
        "optim": {"param_groups": [{"lr": 0.0, "params": []}]},
    }
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path))
    assert torch.equal(out["model"]["w"], sd["model"]["w"]) and torch.equal(out["model"]["b"], sd["model"]["b"])
    assert out["step"] == 3 and out["optim"]["param_groups"][0]["lr"] == 0.5
    # moeckpt.load reads it too
    again = {"model": {"w": torch.zeros(3, 4)}}
    moeckpt.load(again, path)
    assert torch.equal(again["model"]["w"], sd["model"]["w"])


def test_dcp_save_writes_with_the_hosts_spare_cores_and_the_same_bytes(tmp_path, monkeypatch):
    # moeckpt.dcp.StorageWriter writes a rank's file with the threads moeckpt.save would use (its share of the
    # host's cores); the file is the one a single thread writes, byte for byte.
    from moeckpt.formats.backends import safetensors as st
    from moeckpt.reshard import commit

    g = torch.Generator().manual_seed(3)
    sd = {f"layer{i}.w": torch.randn(64, 257, generator=g) for i in range(6)} | {"step": 1}
    used: list[int] = []
    real = st.SafetensorsBackend.write

    def spy(self, storage, writer, pieces, tensors, *, threads=1):
        used.append(threads)
        return real(self, storage, writer, pieces, tensors, threads=threads)

    monkeypatch.setattr(st.SafetensorsBackend, "write", spy)
    files = {}
    for threads in (1, 3):
        monkeypatch.setattr(commit, "cores_per_rank", lambda group=None, n=threads: n)
        path = str(tmp_path / f"t{threads}")
        dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path))
        assert moeckpt.verify(path) == []
        files[threads] = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path) if n != "moeckpt.json"}
    assert used == [1, 3]
    assert files[1] == files[3] and files[1]


def test_a_value_that_is_not_json_is_refused_and_nothing_committed(tmp_path):
    path = str(tmp_path / "c")
    # DCP wraps a rank's error in CheckpointException (a BaseException), whose text carries our one line.
    with pytest.raises(BaseException, match="key 'obj': a value of type object cannot be saved"):
        dcp.save({"w": torch.ones(2), "obj": object()}, storage_writer=moeckpt.dcp.StorageWriter(path))
    assert not os.path.exists(os.path.join(path, "moeckpt.json"))


def test_dcp_load_reads_a_checkpoint_the_trainer_layout_wrote(tmp_path, moeckpt_cli):
    path = str(tmp_path / "c")
    code, _, err = moeckpt_cli(
        "init", path, "--model", "zaya-tiny", "--tp", "2", "--ep", "2", "--dp", "2", "--with-optimizer"
    )
    assert code == 0, err
    reader = moeckpt.CheckpointReader(path)
    names = sorted(reader.index.tensors)[:6] + [n for n in reader.index.tensors if "experts" in n][:2]
    sd = {n: torch.zeros(reader.index.tensors[n].shape) for n in names}
    dcp.load(sd, storage_reader=moeckpt.dcp.StorageReader(path))
    for n in names:
        assert torch.equal(sd[n], reader.read_tensor(n)), n


SPECS_A = {
    "w_rows": ([6, 8], ["SS(0,2)", "S(0)"]),
    "w_cols": ([8, 6], ["S(0)", "S(1)"]),
    "bias": ([8], ["S(0)", "R"]),
    "repl": ([5, 3], ["R", "R"]),
}
SPECS_B = {"w_rows": ([6, 8], ["S(1)"]), "w_cols": ([8, 6], ["S(0)"]), "bias": ([8], ["R"]), "repl": ([5, 3], ["S(0)"])}


@pytest.mark.slow
@pytest.mark.parametrize("writer, reader", [("moeckpt", "moeckpt"), ("moeckpt", "library"), ("library", "moeckpt")])
def test_dcp_resharding_pattern_through_moeckpt(tmp_path, writer, reader):
    path = str(tmp_path / "c")
    run_local_world(w.dcp_save_on_mesh, 4, path, (2, 2), SPECS_A, writer)
    assert moeckpt.verify(path) == []
    out = str(tmp_path / "out")
    os.makedirs(out)
    run_local_world(w.dcp_load_on_mesh, 2, path, (2,), SPECS_B, out, reader)
    for r in range(2):
        report = json.load(open(os.path.join(out, f"rank{r}.json")))
        assert all(report["ok"].values()), report
        assert report["step"] == 7
