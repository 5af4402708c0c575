"""dcp.save through moeckpt.dcp replaces a checkpoint as DCP's FileSystemWriter does, and never removes a file it
did not write."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moeckpt
import moeckpt.dcp


def _load(path, like):
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path))
    return out


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_a_second_save_to_the_same_path_replaces_the_checkpoint(tmp_path, fmt):
    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(3), "old": torch.ones(2)}, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt))
    dcp.save({"w": torch.full((3,), 2.0)}, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt))
    assert moeckpt.verify(path) == []
    assert set(moeckpt.CheckpointReader(path).index.tensors) == {"w"}
    assert torch.equal(_load(path, {"w": torch.ones(3)})["w"], torch.full((3,), 2.0))
    # checkpoint_id= goes through reset(): the same
    dcp.save({"w": torch.full((3,), 3.0)}, checkpoint_id=path, storage_writer=moeckpt.dcp.StorageWriter(format=fmt))
    assert torch.equal(_load(path, {"w": torch.ones(3)})["w"], torch.full((3,), 3.0))


def test_overwrite_false_refuses_a_committed_checkpoint_and_changes_nothing(tmp_path):
    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(3)}, storage_writer=moeckpt.dcp.StorageWriter(path))
    before = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save({"w": torch.zeros(3)}, storage_writer=moeckpt.dcp.StorageWriter(path, overwrite=False))
    assert {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)} == before
    # a directory with no checkpoint in it is no reason to refuse
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    dcp.save({"w": torch.ones(3)}, storage_writer=moeckpt.dcp.StorageWriter(str(other), overwrite=False))
    assert (other / "notes.txt").read_text() == "mine"


def test_torch_save_to_dcp_into_the_directory_of_its_source_keeps_the_source(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.format_utils as fu

    monkeypatch.setattr(fu, "FileSystemWriter", moeckpt.dcp.StorageWriter)
    sd = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2)}}
    src = tmp_path / "model.pt"
    torch.save(sd, src)
    fu.torch_save_to_dcp(str(src), str(tmp_path))
    assert src.exists() and torch.equal(torch.load(src)["model"]["w"], sd["model"]["w"])
    assert moeckpt.verify(str(tmp_path)) == []
    out = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(str(tmp_path)))
    assert torch.equal(out["model"]["w"], sd["model"]["w"])


@pytest.mark.parametrize("first, second", [("safetensors", "zarr"), ("zarr", "safetensors"), ("zarr", "zarr")])
def test_overwriting_beside_other_files_replaces_only_the_checkpoints_own(tmp_path, first, second):
    path = tmp_path / "c"
    path.mkdir()
    (path / "model.pt").write_bytes(b"user data")
    (path / "logs").mkdir()
    (path / "logs" / "run.txt").write_text("kept")
    dcp.save({"a/w": torch.ones(4), "step": 1}, storage_writer=moeckpt.dcp.StorageWriter(str(path), format=first))
    first_files = {os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns}
    dcp.save({"b": torch.full((2,), 5.0)}, storage_writer=moeckpt.dcp.StorageWriter(str(path), format=second))
    assert (path / "model.pt").read_bytes() == b"user data" and (path / "logs" / "run.txt").read_text() == "kept"
    assert moeckpt.verify(str(path)) == []
    index = moeckpt.CheckpointReader(str(path)).index
    assert set(index.tensors) == {"b"} and index.backend == second
    now = {os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns}
    listed = set(
        moeckpt.CheckpointReader(str(path)).backend.stored_objects(moeckpt.CheckpointReader(str(path)).storage, index)
    )
    # what is there now: the new checkpoint and the user's files; nothing of the first checkpoint is left over
    assert now == listed | {"moeckpt.json", "model.pt", "logs/run.txt"}, first_files
    assert not (path / "a").exists() or first == "safetensors"
    assert torch.equal(_load(str(path), {"b": torch.zeros(2)})["b"], torch.full((2,), 5.0))
    assert not any(n.startswith(".") for n in os.listdir(tmp_path)), "no staging left behind"


def test_a_foreign_file_under_a_name_the_save_writes_is_refused_untouched(tmp_path):
    path = tmp_path / "c"
    path.mkdir()
    (path / "rank-00000.safetensors").write_bytes(b"not ours")
    with pytest.raises(BaseException, match="rank-00000.safetensors would be replaced"):
        dcp.save({"w": torch.ones(2)}, storage_writer=moeckpt.dcp.StorageWriter(str(path)))
    assert (path / "rank-00000.safetensors").read_bytes() == b"not ours"
    assert sorted(os.listdir(path)) == ["rank-00000.safetensors"]


def test_on_an_object_store_other_objects_stay_too(tmp_path):
    import fsspec

    url = f"memory://dcp-overwrite-{os.getpid()}/c"
    fs = fsspec.filesystem("memory")
    fs.pipe(url.removeprefix("memory://") + "/notes.txt", b"mine")
    dcp.save({"w": torch.ones(3), "x": torch.ones(1)}, storage_writer=moeckpt.dcp.StorageWriter(url))
    dcp.save({"w": torch.full((3,), 4.0)}, storage_writer=moeckpt.dcp.StorageWriter(url))
    assert fs.cat(url.removeprefix("memory://") + "/notes.txt") == b"mine"
    assert moeckpt.verify(url) == []
    assert torch.equal(_load(url, {"w": torch.zeros(3)})["w"], torch.full((3,), 4.0))
    fs.rm(url.removeprefix("memory://"), recursive=True)
