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

from .. import library_workers as w


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
    from moeckpt.reshard import save_protocol as commit

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


# -- moeckpt.dcp as a drop-in for FileSystemWriter/FileSystemReader ------------------------------------------------


def _files(path):
    return sorted(os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns)


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_values_dcp_saves_are_stored_without_pickle_and_load_as_their_types(tmp_path, fmt):
    import io

    path = str(tmp_path / "c")
    blob = io.BytesIO(b"\x80\x04 bytes that look like a pickle")
    sd = {
        "w": torch.arange(4.0),
        "raw": b"\x00\x01\xffraw",
        "stream": blob,
        "tags": {"x", "y"},
        "dtype": torch.float16,
        "pair": (torch.ones(2, 3), 7),
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]},
        "size": torch.Size([2, 5]),
    }
    dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt))
    assert moeckpt.verify(path) == []
    assert not any(n.endswith((".metadata", ".distcp", ".pt", ".pkl")) for n in _files(path)), "no pickle on disk"
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    assert index["train_state"]["raw"] == {"$type": "bytes", "blob": "raw/$0"}
    # bytes as bytes: the blob is a uint8 tensor holding exactly them
    assert torch.equal(
        moeckpt.CheckpointReader(path).read_tensor("raw/$0"), torch.tensor(list(b"\x00\x01\xffraw"), dtype=torch.uint8)
    )
    out = {
        "w": torch.zeros(4),
        "raw": b"",
        "stream": io.BytesIO(),
        "tags": set(),
        "dtype": torch.float32,
        "pair": (torch.zeros(2, 3), 0),
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
        "size": torch.Size([]),
    }
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path))
    assert torch.equal(out["w"], sd["w"]) and out["raw"] == sd["raw"] and out["tags"] == {"x", "y"}
    assert out["stream"].getvalue() == blob.getvalue() and out["dtype"] is torch.float16
    assert type(out["pair"]) is tuple and torch.equal(out["pair"][0], torch.ones(2, 3)) and out["pair"][1] == 7
    betas = out["optim"]["param_groups"][0]["betas"]
    assert type(betas) is tuple and betas == (0.9, 0.95)
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 5])


def test_a_nested_dict_saved_unflattened_round_trips_as_with_dcps_own_storage(tmp_path):
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    sd = {"model": {"net": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 3, "ids": (1, 2)}, "t": torch.ones(2)}
    got = {}
    for name, writer, reader in [
        ("dcp", dcp.FileSystemWriter, dcp.FileSystemReader),
        ("moeckpt", moeckpt.dcp.StorageWriter, moeckpt.dcp.StorageReader),
    ]:
        path = str(tmp_path / name)
        dcp.save(sd, storage_writer=writer(path), planner=DefaultSavePlanner(flatten_state_dict=False))
        out = {"model": {"net": {"w": torch.zeros(2, 3)}, "step": 0, "ids": ()}, "t": torch.zeros(2)}
        planner = DefaultLoadPlanner(flatten_state_dict=False)
        dcp.load(out, storage_reader=reader(path), planner=planner)
        got[name] = (planner.state_dict["model"], out["t"])
    model, t = got["moeckpt"]
    assert torch.equal(t, sd["t"]) and torch.equal(model["net"]["w"], sd["model"]["net"]["w"])
    assert model["step"] == 3 and model["ids"] == (1, 2) and type(model["ids"]) is tuple
    assert str(got["moeckpt"]) == str(got["dcp"])


def test_read_metadata_keeps_the_planners_data_and_the_version(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = str(tmp_path / "c")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    writer = moeckpt.dcp.StorageWriter(path)
    dcp.save({"model": model.state_dict(), "step": 5}, storage_writer=writer)
    reader = moeckpt.dcp.StorageReader(path)
    md = reader.read_metadata()
    assert md.version == "1.0.0"
    assert md.planner_data["model.0.weight"] == ("model", "0.weight")
    assert md.storage_meta.checkpoint_id == path and md.storage_meta.load_id == reader.load_id
    # no random id on disk: the same state saved again writes the same index
    again = str(tmp_path / "again")
    dcp.save({"model": model.state_dict(), "step": 5}, storage_writer=moeckpt.dcp.StorageWriter(again))
    assert (
        open(os.path.join(path, "moeckpt.json"), "rb").read() == open(os.path.join(again, "moeckpt.json"), "rb").read()
    )
    # DCP's own tools that rebuild the nested state dict from planner_data
    got = _load_state_dict_from_keys("model", storage_reader=moeckpt.dcp.StorageReader(path))
    assert set(got["model"]) == set(model.state_dict())
    out = str(tmp_path / "model.pt")
    import torch.distributed.checkpoint.format_utils as fu

    real = fu.FileSystemReader
    fu.FileSystemReader = moeckpt.dcp.StorageReader
    try:
        dcp_to_torch_save(path, out)
    finally:
        fu.FileSystemReader = real
    loaded = torch.load(out)
    assert set(loaded) == {"model", "step"} and torch.equal(loaded["model"]["1.bias"], model[1].bias.detach())


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.complex64, torch.complex128])
def test_unsigned_and_complex_dtypes_round_trip(tmp_path, fmt, dtype):
    path = str(tmp_path / "c")
    if dtype.is_complex:
        t = torch.complex(torch.arange(6.0), -torch.arange(6.0)).to(dtype).reshape(2, 3)
    else:
        t = torch.tensor([[0, 1, 2], [3, 4, 2**16 - 1]], dtype=torch.int64).to(dtype)
    dcp.save({"t": t}, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt))
    assert moeckpt.verify(path) == []
    out = {"t": torch.zeros(2, 3, dtype=dtype)}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path))
    assert out["t"].dtype == dtype and torch.equal(out["t"], t)


def test_a_planners_transform_object_is_stored_and_load_bytes_gets_its_bytes(tmp_path):
    import codecs
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner

    class Rot13Save(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            buf = super().transform_object(write_item, object)
            if not isinstance(buf, io.BytesIO):
                return buf  # a tensor
            return io.BytesIO(codecs.encode(buf.getvalue().decode("latin-1"), "rot13").encode("latin-1"))

    seen: list[bytes] = []

    class Rot13Load(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            raw = value.read()
            seen.append(raw)
            plain = codecs.decode(raw.decode("latin-1"), "rot13").encode("latin-1")
            super().load_bytes(read_item, io.BytesIO(plain))

    path = str(tmp_path / "c")
    dcp.save({"w": torch.ones(2), "note": "hello"}, storage_writer=moeckpt.dcp.StorageWriter(path), planner=Rot13Save())
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    assert index["train_state"]["note"]["$type"] == "stream"
    out = {"w": torch.zeros(2), "note": ""}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path), planner=Rot13Load())
    assert out["note"] == "hello" and torch.equal(out["w"], torch.ones(2))
    expected = io.BytesIO()
    torch.save("hello", expected)
    assert seen == [codecs.encode(expected.getvalue().decode("latin-1"), "rot13").encode("latin-1")]


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_keys_that_are_not_paths_are_stored_under_safe_names(tmp_path, fmt):
    path = tmp_path / "c"
    keys = ["a//b", "/abs", "x/./y", "x/../y", "..", "a\\b", "100%", "__dunder", "c:/drive"]
    sd = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)} | {"../escape": 1, "/etc/passwd": b"x"}
    dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(str(path), format=fmt))
    assert moeckpt.verify(str(path)) == []
    # every stored object is inside the checkpoint, and nothing was written beside it
    assert sorted(os.listdir(tmp_path)) == ["c"]
    for f in _files(path):
        assert not f.startswith("..") and os.path.realpath(path / f).startswith(os.path.realpath(path) + os.sep)
    out = {k: torch.zeros(2) for k in keys} | {"../escape": 0, "/etc/passwd": b""}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(str(path)))
    for i, k in enumerate(keys):
        assert torch.equal(out[k], torch.full((2,), float(i))), k
    assert out["../escape"] == 1 and out["/etc/passwd"] == b"x"
    assert set(moeckpt.dcp.StorageReader(str(path)).read_metadata().state_dict_metadata) == set(sd)


def test_validate_checkpoint_id_is_true_only_for_what_the_storages_open():
    for cls in (moeckpt.dcp.StorageWriter, moeckpt.dcp.StorageReader):
        assert cls.validate_checkpoint_id("/tmp/some/ckpt") and cls.validate_checkpoint_id("relative/ckpt")
        assert cls.validate_checkpoint_id("file:///tmp/ckpt") and cls.validate_checkpoint_id("memory://bucket/c")
        import pathlib

        assert cls.validate_checkpoint_id(pathlib.Path("/tmp/x"))
        assert not cls.validate_checkpoint_id("abc://abc.abc")
        assert not cls.validate_checkpoint_id("")
        assert not cls.validate_checkpoint_id(None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_world(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))  # the process mode's checkpoint process joins here
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Counter:
    """A stateful object as DCP takes them: its state_dict() is saved, load_state_dict() gets it back."""

    def __init__(self, n: int = 0) -> None:
        self.n, self.seen = n, torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "seen": self.seen}

    def load_state_dict(self, sd) -> None:
        self.n, self.seen = sd["n"], sd["seen"]


def _async_round_trip(tmp_path, kind, stager) -> None:
    import io

    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model = torch.nn.Linear(3, 2)
    counter = _Counter(9)
    counter.seen = torch.arange(3.0)
    sd = {"model": model.state_dict(), "counter": counter, "blob": io.BytesIO(b"xyz")}
    path = str(tmp_path / "c")
    result = dcp.async_save(
        sd,
        storage_writer=moeckpt.dcp.StorageWriter(path),
        async_checkpointer_type=getattr(AsyncCheckpointerType, kind),
        async_stager=stager,
    )
    (getattr(result, "upload_completion", None) or result).result()
    assert moeckpt.verify(path) == []
    back = _Counter()
    out = {"model": torch.nn.Linear(3, 2).state_dict(), "counter": back, "blob": io.BytesIO()}
    dcp.load(out, storage_reader=moeckpt.dcp.StorageReader(path))
    assert torch.equal(out["model"]["weight"], model.weight) and back.n == 9 and torch.equal(back.seen, counter.seen)
    assert out["blob"].getvalue() == b"xyz"


def test_async_save_in_a_thread_with_and_without_dcps_stager(tmp_path, one_rank_world):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _async_round_trip(tmp_path / "plain", "THREAD", None)
    _async_round_trip(tmp_path / "staged", "THREAD", DefaultStager(StagingOptions(False, False, False, False)))


@pytest.mark.slow
def test_async_save_in_dcps_checkpoint_process(tmp_path, one_rank_world):
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    _async_round_trip(tmp_path / "staged", "PROCESS", DefaultStager(StagingOptions(False, True, False, False)))
