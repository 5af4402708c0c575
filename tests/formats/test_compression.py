"""Lossless compression of zarr checkpoints (``--compress blosc-zstd``, issue 32): bit-exact round trips through
every command that writes, chunks really smaller, damage found, standard readers (zarr-python, tensorstore and the
spec reader) decoding the arrays without moeckpt, and the index version 4 only when compressed."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch
import zarr

import moeckpt
from moeckpt.formats.backends.zarr_cells import INDEX_ENTRY_BYTES
from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.formats.errors import CheckpointIndexError, MoeckptError
from moeckpt.formats.index import FORMAT_VERSION

from .. import spec_reader as spec
from ..spec_reader import SpecError

INIT = ["--model", "zaya-tiny", "--with-optimizer", "--dtype", "bf16", "--seed", "7"]


def _bytes(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _index(path) -> dict:
    return json.load(open(os.path.join(path, "moeckpt.json")))


def _same_values(a, b) -> None:
    ra, rb = CheckpointReader(str(a)), CheckpointReader(str(b))
    assert set(ra.index.tensors) == set(rb.index.tensors)
    for name in ra.index.tensors:
        assert _bytes(ra.read_tensor(name)) == _bytes(rb.read_tensor(name)), name


def _conforms(path) -> spec.Checkpoint:
    """The spec reader checks everything and reads every tensor as moeckpt does, bit for bit."""
    ckpt = spec.Checkpoint(str(path))
    values = ckpt.check()
    reader = CheckpointReader(str(path))
    for name, value in values.items():
        assert value.tobytes() == _bytes(reader.read_tensor(name)), name
    assert verify(reader) == []
    return ckpt


def _one_line_refusal(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err


@pytest.fixture
def pair(tmp_path, moeckpt_cli):
    """The same logical checkpoint (tp=1 ep=2 dp=2, bf16 with AdamW state) written compressed and raw."""
    packed, raw = tmp_path / "packed", tmp_path / "raw"
    for path, extra in ((packed, ["--compress", "blosc-zstd"]), (raw, [])):
        code, _, err = moeckpt_cli("init", path, *INIT, "--ep", 2, "--dp", 2, "--format", "zarr", *extra)
        assert code == 0, err
    return packed, raw


def _state() -> dict:
    """Compressible values of several dtypes: a sharded cell (8 MiB of float32 > the 4 MiB inner-chunk limit), a
    plain-chunk bf16 tensor of trained-looking values, small ints, a 0-d and an empty tensor."""
    gen = torch.Generator().manual_seed(0)
    return {
        "big": (torch.arange(2048 * 1024, dtype=torch.float32) % 97).reshape(2048, 1024),
        "w": (torch.randn(256, 128, generator=gen) * 0.02).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64) % 10,
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 3),
    }


def _save_state(path, **kw) -> None:
    moeckpt.save(_state(), str(path), format="zarr", **kw)


# -- round trip, version, sizes ------------------------------------------------------------------------------------


def test_init_compressed_reads_back_bit_equal_and_only_it_is_version_4(pair, moeckpt_cli):
    packed, raw = pair
    _same_values(packed, raw)
    code, out, err = moeckpt_cli("diff", packed, raw)
    assert code == 0 and "identical" in out, out + err
    assert moeckpt_cli("verify", packed)[0] == 0
    doc = _index(packed)
    assert doc["format_version"] == 4 and doc["compress"] == "blosc-zstd"
    assert list(doc)[:4] == ["format", "format_version", "backend", "compress"]
    # the uncompressed twin: the version and documents of before (no compress member, no blosc, data version 1)
    doc = _index(raw)
    assert doc["format_version"] == 1 and "compress" not in doc
    arr = json.load(open(raw / "model.embed_tokens.weight" / "zarr.json"))
    assert "blosc" not in json.dumps(arr) and arr["attributes"]["moeckpt"]["format_version"] == 1
    assert CheckpointReader(str(raw)).index.compress == "none"
    assert CheckpointReader(str(packed)).index.compress == "blosc-zstd"


def test_inspect_names_the_compression_and_counts_the_stored_bytes(tmp_path, moeckpt_cli):
    _save_state(tmp_path / "packed", compress="blosc-zstd")
    _save_state(tmp_path / "raw")
    info = {k: json.loads(moeckpt_cli("inspect", tmp_path / k, "--json")[1]) for k in ("packed", "raw")}
    assert info["packed"]["compress"] == "blosc-zstd" and info["raw"]["compress"] == "none"
    assert info["packed"]["logical_bytes"] == info["raw"]["logical_bytes"]
    assert info["packed"]["stored_bytes"] < 0.2 * info["raw"]["stored_bytes"]
    code, out, _ = moeckpt_cli("inspect", tmp_path / "packed")
    assert code == 0 and "moeckpt v4 (zarr, compressed blosc-zstd)" in out
    code, out, _ = moeckpt_cli("inspect", tmp_path / "raw")
    assert code == 0 and "moeckpt v2 (zarr)" in out


def test_the_spec_reader_reads_compressed_checkpoints_as_moeckpt_does(pair, tmp_path):
    packed, raw = pair
    assert _conforms(packed).version == 4
    assert _conforms(raw).version == 1
    _save_state(tmp_path / "s", compress="blosc-zstd")
    assert _conforms(tmp_path / "s").version == 4


def test_compressible_chunks_are_stored_smaller_than_raw(tmp_path):
    _save_state(tmp_path / "packed", compress="blosc-zstd")
    _save_state(tmp_path / "raw")
    _same_values(tmp_path / "packed", tmp_path / "raw")
    for name, cell, most in (("big", "c/0/0", 0.05), ("w", "c/0/0", 0.85), ("ids", "c/0", 0.2)):
        packed = os.path.getsize(tmp_path / "packed" / name / cell)
        plain = os.path.getsize(tmp_path / "raw" / name / cell)
        assert packed < most * plain, (name, packed, plain)
    doc = json.load(open(tmp_path / "packed" / "big" / "zarr.json"))
    sharding = doc["codecs"][0]
    assert sharding["name"] == "sharding_indexed"  # the large cell is a shard of compressed inner chunks
    assert [c["name"] for c in sharding["configuration"]["codecs"]] == ["bytes", "crc32c", "blosc", "crc32c"]
    assert sharding["configuration"]["codecs"][2]["configuration"]["typesize"] == 4
    assert doc["attributes"]["moeckpt"] == {"dtype": "float32", "format_version": 2}
    w = json.load(open(tmp_path / "packed" / "w" / "zarr.json"))
    assert [c["name"] for c in w["codecs"]] == ["bytes", "crc32c", "blosc", "crc32c"]
    assert w["codecs"][2]["configuration"] == {
        "cname": "zstd",
        "clevel": 1,
        "shuffle": "shuffle",
        "typesize": 2,
        "blocksize": 1048576,
    }


def test_a_read_of_some_rows_of_a_compressed_shard_is_right(tmp_path):
    _save_state(tmp_path / "s", compress="blosc-zstd")
    reader = CheckpointReader(str(tmp_path / "s"))
    (ref,) = [r for r in reader.backend.list_pieces(reader.storage, reader.index) if r.tensor == "big"]
    want = _state()["big"]
    for r0, r1 in ((0, 1), (1000, 1030), (1023, 1025), (2047, 2048), (0, 2048)):
        got = reader.backend.read_piece(reader.storage, ref, rows=(r0, r1))
        assert torch.equal(got, want[r0:r1]), (r0, r1)


# -- damage ---------------------------------------------------------------------------------------------------------


def _flip(path, at: int | None = None) -> None:
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x40
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("tensor,cell", [("w", "c/0/0"), ("big", "c/0/0"), ("step", "c")])
def test_verify_finds_a_flipped_byte_in_a_compressed_chunk(tmp_path, moeckpt_cli, tensor, cell):
    _save_state(tmp_path / "s", compress="blosc-zstd")
    obj = tmp_path / "s" / tensor / cell
    # in a shard, a byte of the inner chunks (past the index); elsewhere the middle of the frame
    _flip(obj, None if tensor != "big" else os.path.getsize(obj) - 100)
    problems = verify(CheckpointReader(str(tmp_path / "s")))
    assert problems and all(tensor in p for p in problems), problems
    code, out, err = moeckpt_cli("verify", tmp_path / "s")
    assert code == 1 and tensor in out + err
    with pytest.raises(MoeckptError):
        CheckpointReader(str(tmp_path / "s")).read_tensor(tensor)
    with pytest.raises(SpecError, match="crc32c"):
        spec.Checkpoint(str(tmp_path / "s")).tensor(tensor)


def test_a_damaged_shard_index_is_found(tmp_path):
    _save_state(tmp_path / "s", compress="blosc-zstd")
    _flip(tmp_path / "s" / "big" / "c" / "0" / "0", INDEX_ENTRY_BYTES + 3)
    problems = verify(CheckpointReader(str(tmp_path / "s")))
    assert problems and all("big" in p for p in problems), problems


# -- reshard, diff ---------------------------------------------------------------------------------------------------


def test_reshard_keeps_or_changes_the_compression_and_values_stay_equal(pair, tmp_path, moeckpt_cli):
    packed, raw = pair
    cases = [
        # (source, extra arguments, format_version and compress of the target)
        (packed, ["--tp", 2], 4, "blosc-zstd"),  # the source's setting is kept by default
        (packed, ["--compress", "none"], 1, None),
        (raw, ["--compress", "blosc-zstd", "--ep", 1], 4, "blosc-zstd"),
        # safetensors cannot compress: the default is none there; its zaya pieces are checksummed along the TP
        # split (version 5)
        (packed, ["--format", "safetensors"], 5, None),
        (packed, ["--format", "safetensors", "--compress", "none"], 5, None),
    ]
    for i, (src, extra, version, compress) in enumerate(cases):
        dst = tmp_path / f"out{i}"
        code, _, err = moeckpt_cli("reshard", src, dst, *extra)
        assert code == 0, (extra, err)
        doc = _index(dst)
        assert (doc["format_version"], doc.get("compress")) == (version, compress), extra
        for other in (packed, raw):
            code, out, err = moeckpt_cli("diff", dst, other)
            assert code == 0, (extra, out, err)
        assert verify(CheckpointReader(str(dst))) == []
    _conforms(tmp_path / "out2")


def test_reshard_to_a_format_that_cannot_compress_is_refused_in_one_line(pair, tmp_path, moeckpt_cli):
    packed, raw = pair
    code, _, err = moeckpt_cli(
        "reshard", packed, tmp_path / "st", "--format", "safetensors", "--compress", "blosc-zstd"
    )
    _one_line_refusal(code, err, "safetensors", "blosc-zstd")
    assert not os.path.exists(tmp_path / "st")
    code, _, _ = moeckpt_cli("init", tmp_path / "src-st", *INIT)
    assert code == 0
    code, _, err = moeckpt_cli("reshard", tmp_path / "src-st", tmp_path / "st2", "--compress", "blosc-zstd")
    _one_line_refusal(code, err, "safetensors")
    assert not os.path.exists(tmp_path / "st2")


# -- every command that writes ---------------------------------------------------------------------------------------


def test_init_with_safetensors_refuses_compression_in_one_line(tmp_path, moeckpt_cli):
    code, _, err = moeckpt_cli("init", tmp_path / "c", *INIT, "--compress", "blosc-zstd")
    _one_line_refusal(code, err, "safetensors", "blosc-zstd", "zarr")
    assert not os.path.exists(tmp_path / "c")
    code, _, err = moeckpt_cli("init", tmp_path / "c", *INIT, "--format", "zarr", "--compress", "lz4")
    assert code == 2 and "--compress" in err


def test_import_hf_and_import_dcp_write_compressed(tmp_path, moeckpt_cli):
    import torch.distributed.checkpoint as dcp

    code, _, err = moeckpt_cli("init", tmp_path / "base", "--model", "zaya-tiny", "--seed", 3)
    assert code == 0, err
    assert moeckpt_cli("export-hf", tmp_path / "base", tmp_path / "hf")[0] == 0
    for fmt, extra in (("zarr", ["--compress", "blosc-zstd"]), ("zarr", [])):
        dst = tmp_path / f"hf-{len(extra)}"
        code, _, err = moeckpt_cli("import-hf", tmp_path / "hf", dst, "--format", fmt, "--ep", 2, "--dp", 2, *extra)
        assert code == 0, err
    assert _index(tmp_path / "hf-2")["compress"] == "blosc-zstd" and "compress" not in _index(tmp_path / "hf-0")
    _same_values(tmp_path / "hf-2", tmp_path / "hf-0")
    code, _, err = moeckpt_cli("import-hf", tmp_path / "hf", tmp_path / "hf-st", "--compress", "blosc-zstd")
    _one_line_refusal(code, err, "safetensors")

    sd = {"w": torch.arange(48.0).reshape(8, 6), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 11}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for extra in (["--compress", "blosc-zstd"], []):
        dst = tmp_path / f"dcp-{len(extra)}"
        code, _, err = moeckpt_cli("import-dcp", tmp_path / "dcp", dst, "--dp", 2, "--format", "zarr", *extra)
        assert code == 0, err
    doc = _index(tmp_path / "dcp-2")
    assert doc["format_version"] == 4 and doc["compress"] == "blosc-zstd" and doc["meshes"]
    _same_values(tmp_path / "dcp-2", tmp_path / "dcp-0")
    assert torch.equal(CheckpointReader(str(tmp_path / "dcp-2")).read_tensor("w"), sd["w"])
    code, _, err = moeckpt_cli("import-dcp", tmp_path / "dcp", tmp_path / "dcp-st", "--compress", "blosc-zstd")
    _one_line_refusal(code, err, "safetensors")


def test_moeckpt_save_compresses_zarr_and_refuses_safetensors(tmp_path):
    state = _state()
    stats = moeckpt.save(state, str(tmp_path / "z"), format="zarr", compress="blosc-zstd")
    assert stats.bytes_written > 0
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    moeckpt.load(back, str(tmp_path / "z"))
    assert all(_bytes(back[k]) == _bytes(v) for k, v in state.items())
    assert _index(tmp_path / "z")["format_version"] == 4

    moeckpt.async_save(state, str(tmp_path / "a"), format="zarr", compress="blosc-zstd").wait()
    _same_values(tmp_path / "a", tmp_path / "z")

    for save in (moeckpt.save, moeckpt.async_save):
        with pytest.raises(CheckpointIndexError, match="safetensors format stores bytes raw"):
            save(state, str(tmp_path / "st"), format="safetensors", compress="blosc-zstd")
        with pytest.raises(CheckpointIndexError, match="unknown compression"):
            save(state, str(tmp_path / "st"), format="zarr", compress="gzip")
        assert not os.path.exists(tmp_path / "st")


def test_the_checkpointer_saves_compressed_and_refuses_safetensors_at_once(tmp_path):
    ckpt = moeckpt.Checkpointer(str(tmp_path / "run"), format="zarr", compress="blosc-zstd", async_save=False)
    ckpt.save(1, {"w": torch.arange(10.0)})
    assert _index(tmp_path / "run" / "step-00000001")["compress"] == "blosc-zstd"
    with pytest.raises(CheckpointIndexError, match="stores bytes raw"):
        moeckpt.Checkpointer(str(tmp_path / "run2"), compress="blosc-zstd")


def test_train_config_takes_compress_for_zarr_only(moeckpt_cli, tmp_path):
    from moeckpt.trainer.config import TrainConfig

    assert TrainConfig(model="zaya-tiny", run_dir="r").compress == "none"
    assert TrainConfig(model="zaya-tiny", run_dir="r", format="zarr", compress="blosc-zstd").compress == "blosc-zstd"
    with pytest.raises(ValueError, match="compress="):
        TrainConfig(model="zaya-tiny", run_dir="r", compress="blosc-zstd")
    with pytest.raises(ValueError, match="compress="):
        TrainConfig(model="zaya-tiny", run_dir="r", format="zarr", compress="gzip")
    code, _, err = moeckpt_cli("train", "--model", "zaya-tiny", "--run-dir", tmp_path / "r", "--compress", "blosc-zstd")
    _one_line_refusal(code, err, "--compress", "safetensors")
    assert not os.path.exists(tmp_path / "r")


def test_train_writes_compressed_checkpoints_and_resumes_from_them(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    common = ["--model", "zaya-tiny", "--seq-len", 32, "--global-batch", 4, "--cpu", "--warmup-steps", 1]
    common += ["--run-dir", run, "--format", "zarr", "--compress", "blosc-zstd", "--save-every", 2]
    code, _, err = moeckpt_cli("train", *common, "--steps", 2)
    assert code == 0, err
    doc = _index(run / "step-00000002")
    assert doc["format_version"] == 4 and doc["compress"] == "blosc-zstd"
    assert verify(CheckpointReader(str(run / "step-00000002"))) == []
    code, out, err = moeckpt_cli("train", *common, "--steps", 4)  # resumes from the compressed step 2
    assert code == 0, err
    assert _index(run / "step-00000004")["compress"] == "blosc-zstd"
    assert "step 4/4" in out


def _full(name: str) -> torch.Tensor:
    """A compressible value, the same on every rank: 2,304 x 1,024 float32 (9 MiB, sharded cells) or bf16 rows."""
    if name == "w":
        return (torch.arange(2304 * 1024, dtype=torch.float32) % 89).reshape(2304, 1024)
    return (torch.arange(6 * 100, dtype=torch.float32) / 7).to(torch.bfloat16).reshape(6, 100)


def save_compressed_on_two_ranks(rank: int, path: str, use_async: bool) -> None:
    """(run by run_local_world) DTensors split over a mesh of 2 and a replicated plain tensor, saved compressed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sd = {
        "w": distribute_tensor(_full("w"), mesh, [Shard(0)], src_data_rank=None),
        "b": distribute_tensor(_full("b"), mesh, [Shard(1)], src_data_rank=None),
        "step": torch.tensor(4.0),
    }
    if use_async:
        moeckpt.async_save(sd, path, format="zarr", compress="blosc-zstd").wait()
    else:
        moeckpt.save(sd, path, format="zarr", compress="blosc-zstd")


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_two_ranks_save_compressed_and_every_reader_gets_the_values(tmp_path, use_async):
    from moeckpt.trainer.local_world import run_local_world

    path = tmp_path / "c"
    run_local_world(save_compressed_on_two_ranks, 2, str(path), use_async)
    assert _index(path)["format_version"] == 4 and moeckpt.verify(str(path)) == []
    reader = CheckpointReader(str(path))
    for name in ("w", "b"):
        assert _bytes(reader.read_tensor(name)) == _bytes(_full(name)), name
        got = np.array(zarr.open_array(store=str(path), path=name, mode="r")[...])
        assert got.tobytes() == _bytes(_full(name)), name
    assert json.load(open(path / "w" / "zarr.json"))["codecs"][0]["name"] == "sharding_indexed"
    _conforms(path)


# -- other readers -------------------------------------------------------------------------------------------------


def _arrays(path) -> list[tuple[str, str, torch.Tensor]]:
    reader = CheckpointReader(str(path))
    return [(name, e.dtype, reader.read_tensor(name)) for name, e in reader.index.tensors.items()]


def test_zarr_python_reads_every_compressed_array_equal(pair, tmp_path):
    packed, _ = pair
    _save_state(tmp_path / "s", compress="blosc-zstd")
    for path in (packed, tmp_path / "s"):
        for name, dtype, want in _arrays(path):
            arr = zarr.open_array(store=str(path), path=name, mode="r")
            assert arr.attrs["moeckpt"]["dtype"] == dtype
            got = np.array(arr[...])
            assert got.tobytes() == _bytes(want), name
    part = zarr.open_array(store=str(tmp_path / "s"), path="big", mode="r")[1000:1030]
    assert np.array_equal(part, _state()["big"][1000:1030].numpy())


def test_zarr_python_refuses_a_flipped_byte_in_a_compressed_chunk(tmp_path):
    _save_state(tmp_path / "s", compress="blosc-zstd")
    _flip(tmp_path / "s" / "w" / "c" / "0" / "0")
    with pytest.raises(Exception, match="(?i)checksum|crc"):
        zarr.open_array(store=str(tmp_path / "s"), path="w", mode="r")[...]


def test_tensorstore_reads_every_compressed_array_equal(pair, tmp_path):
    ts = pytest.importorskip("tensorstore", reason="tensorstore (tests/requirements-clients.txt) is not installed")
    packed, _ = pair
    _save_state(tmp_path / "s", compress="blosc-zstd")
    for path in (packed, tmp_path / "s"):
        for name, _, want in _arrays(path):
            if want.numel() == 0:
                continue
            spec_ = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(str(path), name) + "/"}}
            got = ts.open(spec_, read=True).result().read().result()
            assert np.asarray(got).tobytes() == _bytes(want), name


# -- the index -----------------------------------------------------------------------------------------------------


def _edit(path, edit) -> None:
    doc = _index(path)
    edit(doc)
    with open(os.path.join(path, "moeckpt.json"), "w") as f:
        json.dump(doc, f)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d.update(format_version=3), "version"),
        (lambda d: d.update(compress="gzip"), "compress"),
        (lambda d: d.update(backend="safetensors"), "compress"),
        (lambda d: d.update(format_version=FORMAT_VERSION + 1), "version"),
    ],
    ids=["compress-in-version-3", "unknown-compression", "compress-with-safetensors", "version-above-known"],
)
def test_both_readers_refuse_a_bad_compress_member(tmp_path, edit, match):
    _save_state(tmp_path / "s", compress="blosc-zstd")
    _edit(tmp_path / "s", edit)
    with pytest.raises(MoeckptError, match=match):
        CheckpointReader(str(tmp_path / "s"))
    with pytest.raises(SpecError, match=match):
        spec.Checkpoint(str(tmp_path / "s"))


def _drop_compress(doc: dict) -> None:
    del doc["compress"]
    doc["format_version"] = 2


@pytest.mark.parametrize(
    "compress,edit",
    [
        ("none", lambda d: d.update(format_version=4, compress="blosc-zstd")),
        ("blosc-zstd", _drop_compress),
    ],
    ids=["compressed-index-over-raw-arrays", "raw-index-over-compressed-arrays"],
)
def test_both_readers_refuse_arrays_whose_codecs_the_index_does_not_say(tmp_path, compress, edit):
    """The index's compress member decides every array's document: the two disagreeing break the spec."""
    _save_state(tmp_path / "s", compress=compress)
    _edit(tmp_path / "s", edit)
    with pytest.raises(MoeckptError, match="compression"):
        CheckpointReader(str(tmp_path / "s")).read_tensor("w")
    with pytest.raises(SpecError, match="array document"):
        spec.Checkpoint(str(tmp_path / "s")).pieces()
