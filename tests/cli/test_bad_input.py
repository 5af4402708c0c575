"""Bad input and faults: one clear line, the right exit code, never a committed-looking torn checkpoint."""

from __future__ import annotations

import json
import os
import struct

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeckpt.formats import errors
from moeckpt.formats.backends.safetensors import read_header
from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.formats.index import INDEX_NAME, Index
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout

from ..helpers import save_toy


@pytest.fixture
def ckpt(tmp_path) -> str:
    location = str(tmp_path / "ckpt")
    save_toy(location, Layout(tp=2, ep=2, dp=2))
    return location


def _rewrite_index(location: str, edit) -> None:
    path = os.path.join(location, INDEX_NAME)
    with open(path) as f:
        doc = json.load(f)
    edit(doc)
    with open(path, "w") as f:
        json.dump(doc, f)


# -- the CLI contract: exit codes and one line --------------------------------------------------------


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moeckpt: error:"), err
    assert "Traceback" not in err
    return lines[0]


def test_bit_flip_fails_verify_naming_file_and_tensor(ckpt, moeckpt_cli):
    path = os.path.join(ckpt, "rank-00003.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    code, _, err = moeckpt_cli("verify", ckpt)
    assert code == 1
    assert "rank-00003.safetensors" in err and "checksum mismatch in tensor" in err


def test_truncated_file(ckpt, moeckpt_cli):
    path = os.path.join(ckpt, "rank-00001.safetensors")
    os.truncate(path, os.path.getsize(path) - 10)
    code, _, err = moeckpt_cli("verify", ckpt)
    assert code == 1 and "truncated" in err and "rank-00001.safetensors" in err
    code, _, err = moeckpt_cli("diff", ckpt, ckpt)
    assert code == 2 and "truncated" in _one_line_error(err)


def test_missing_rank_file(ckpt, moeckpt_cli):
    os.remove(os.path.join(ckpt, "rank-00002.safetensors"))
    code, _, err = moeckpt_cli("verify", ckpt)
    assert code == 1 and "rank-00002.safetensors" in err and "missing" in err
    # one line for the file, one for the tensors it leaves incomplete, the summary: not one line per tensor
    lines = err.strip().splitlines()
    assert len(lines) == 3 and "incomplete because of the unreadable file" in lines[1], err


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x00\xffgarbage", "not valid JSON"),
        (b"[1, 2]", "not a moeckpt index"),
        (json.dumps({"format": "moeckpt", "format_version": 99}).encode(), "format version 99 is not supported"),
    ],
)
def test_garbage_or_future_index(ckpt, moeckpt_cli, content, message):
    with open(os.path.join(ckpt, INDEX_NAME), "wb") as f:
        f.write(content)
    for cmd in (("inspect", ckpt), ("diff", ckpt, ckpt)):
        code, _, err = moeckpt_cli(*cmd)
        assert code == 2 and message in _one_line_error(err), cmd
    # verify: a checkpoint that exists but whose index is damaged fails the check (exit 1, docs/cli.md); one this
    # version cannot check (a newer format) is bad input (exit 2)
    code, _, err = moeckpt_cli("verify", ckpt)
    if "format version" in message:
        assert code == 2 and message in _one_line_error(err)
    else:
        assert code == 1 and message in err and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("moeckpt: verify failed: 1 problem(s)")


@pytest.mark.parametrize("evil", ["../outside.safetensors", "/etc/passwd", "a/../../b", "s3://other/x", "..\\x"])
def test_index_paths_cannot_escape(ckpt, moeckpt_cli, evil):
    def edit(doc):
        doc["files"][evil] = doc["files"].pop("rank-00000.safetensors")

    _rewrite_index(ckpt, edit)
    code, _, err = moeckpt_cli("inspect", ckpt)
    assert code == 2 and "not a plain relative path" in _one_line_error(err)


def test_unknown_preset_and_bad_layouts(tmp_path, moeckpt_cli):
    out = str(tmp_path / "x")
    code, _, err = moeckpt_cli("init", out, "--model", "gpt-17")
    assert code == 2 and "unknown model preset 'gpt-17'" in _one_line_error(err)
    code, _, err = moeckpt_cli("init", out, "--model", "zaya-tiny", "--tp", "4")
    assert code == 2 and "num_key_value_heads" in _one_line_error(err)
    code, _, err = moeckpt_cli("init", out, "--model", "qwen3moe-tiny", "--ep", "8", "--dp", "8")
    assert code == 2 and "ep=8 must divide num_experts=4" in _one_line_error(err)
    code, _, err = moeckpt_cli("init", out, "--model", "zaya-tiny", "--ep", "2", "--dp", "3")
    assert code == 2 and "ep=2 must divide dp=3" in _one_line_error(err)
    assert not os.path.exists(out)


def test_non_empty_out_refused_unless_overwrite(ckpt, moeckpt_cli):
    code, _, err = moeckpt_cli("init", ckpt, "--model", "zaya-tiny")
    assert code == 2 and "--overwrite" in _one_line_error(err)
    code, out, _ = moeckpt_cli("init", ckpt, "--model", "zaya-tiny", "--overwrite")
    assert code == 0
    assert CheckpointReader(ckpt).index.model["arch"] == "zaya"


def _zaya_tiny(cli, tmp_path):
    code, _, err = cli("init", tmp_path / "zt", "--model", "zaya-tiny")
    assert code == 0, err
    return tmp_path / "zt"


@pytest.mark.parametrize("command", ["init", "reshard", "export-hf"])
def test_a_file_at_the_destination_is_never_replaced(tmp_path, moeckpt_cli, command):
    """listdir sees no entries in a plain file; the commit used to rename the user's file away and delete it."""
    ckpt = _zaya_tiny(moeckpt_cli, tmp_path)
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    args = {
        "init": ("init", target, "--model", "zaya-tiny"),
        "reshard": ("reshard", ckpt, target),
        "export-hf": ("export-hf", ckpt, target),
    }[command]
    for extra in ((), ("--overwrite",)):
        code, _, err = moeckpt_cli(*args, *extra)
        assert code == 2 and "is a file, not a directory" in _one_line_error(err)
        assert target.read_text() == "keep me"


@pytest.mark.parametrize("command", ["init", "reshard", "export-hf"])
def test_unwritable_destination_is_one_line(tmp_path, moeckpt_cli, command):
    ckpt = _zaya_tiny(moeckpt_cli, tmp_path)
    (tmp_path / "f").write_text("x")
    where = tmp_path / "f" / "sub"  # a path below a file: cannot be created
    args = {
        "init": ("init", where, "--model", "zaya-tiny"),
        "reshard": ("reshard", ckpt, where),
        "export-hf": ("export-hf", ckpt, where),
    }[command]
    code, _, err = moeckpt_cli(*args)
    assert code == 2 and "cannot create" in _one_line_error(err)


def test_reshard_never_writes_over_its_source(tmp_path, moeckpt_cli):
    run = tmp_path / "run"
    code, _, err = moeckpt_cli("init", run / "step-00000007", "--model", "zaya-tiny")
    assert code == 0, err
    before = sorted(os.listdir(run / "step-00000007"))
    for dst, word in (
        (run / "step-00000007", "is the source"),
        (run / "step-00000007" / "sub", "is inside"),
        (run, "holds"),
    ):
        for extra in ((), ("--overwrite",)):
            code, _, err = moeckpt_cli("reshard", run, dst, "--dp", 2, *extra)
            assert code == 2 and word in _one_line_error(err)
    assert sorted(os.listdir(run)) == ["step-00000007"]
    assert sorted(os.listdir(run / "step-00000007")) == before
    assert verify(CheckpointReader(str(run / "step-00000007"))) == []


def test_missing_checkpoint(tmp_path, moeckpt_cli):
    code, _, err = moeckpt_cli("inspect", str(tmp_path / "nothing"))
    assert code == 2 and "no such checkpoint" in _one_line_error(err)


# -- a write failing midway -------------------------------------------------------------------------------


class FailingFileSystem(MemoryFileSystem):
    """A memory filesystem whose writes start failing after a budget of bytes (a full disk, a dying S3)."""

    protocol = "failmem"
    budget = 0
    store: dict = {}
    pseudo_dirs = [""]

    def _open(self, path, mode="rb", **kw):
        f = super()._open(path, mode, **kw)
        if "w" in mode:
            inner_write = f.write

            def write(data):
                FailingFileSystem.budget -= len(data)
                if FailingFileSystem.budget < 0:
                    raise OSError(28, "No space left on device")
                return inner_write(data)

            f.write = write
        return f


fsspec.register_implementation("failmem", FailingFileSystem, clobber=True)


def test_write_failing_midway_leaves_nothing_committed():
    FailingFileSystem.budget = 20_000
    location = "failmem://bucket/run/step-00000001"
    with pytest.raises(errors.StorageError, match="no space left"):
        save_toy(location, Layout(tp=2, ep=2, dp=2), workers=1)
    assert not open_storage(location).exists(INDEX_NAME)
    assert open_storage(location).listdir(), "the failed save did write something before failing"
    with pytest.raises(errors.NotCommittedError):
        CheckpointReader("failmem://bucket/run")
    FailingFileSystem.budget = 10**9
    with pytest.raises(errors.DestinationNotEmptyError):
        save_toy(location, Layout())  # leftovers are not silently mixed with a new save
    save_toy(location, Layout(), overwrite=True)
    assert CheckpointReader("failmem://bucket/run").index.layout == Layout().to_json()


def test_local_write_failing_midway_leaves_only_a_staging_dir(tmp_path, monkeypatch):
    from moeckpt.formats.backends import safetensors as safetensors_backend

    real = safetensors_backend.write_file
    calls = []

    def flaky(storage, relpath, pieces, tensors):
        calls.append(relpath)
        if len(calls) == 3:
            raise errors.StorageError(f"{storage.path(relpath)}: simulated I/O error")
        return real(storage, relpath, pieces, tensors)

    monkeypatch.setattr(safetensors_backend, "write_file", flaky)
    location = str(tmp_path / "ckpt")
    with pytest.raises(errors.StorageError):
        save_toy(location, Layout(tp=2, ep=2, dp=2), workers=1)
    assert not os.path.exists(location)
    assert os.listdir(tmp_path) == [".ckpt.partial"]
    with pytest.raises(errors.NotCommittedError):
        CheckpointReader(location)
    monkeypatch.setattr(safetensors_backend, "write_file", real)
    save_toy(location, Layout())  # the next save replaces the leftovers
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


# -- fuzzing: hostile bytes never end in a traceback -----------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400))
def test_fuzzed_index_bytes_raise_only_typed_errors(data):
    try:
        Index.loads(data, "fuzz")
    except errors.MoeckptError:
        pass


def _valid_index_doc(tmp_path_factory=None):
    import tempfile

    d = tempfile.mkdtemp()
    save_toy(d + "/c", Layout(tp=2, dp=2, ep=2))
    with open(d + "/c/" + INDEX_NAME) as f:
        return d + "/c", json.load(f)


_VALID_LOCATION, _VALID_DOC = _valid_index_doc()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_index_raises_only_typed_errors(data):
    doc = json.loads(json.dumps(_VALID_DOC))
    # replace one value somewhere in the document with arbitrary JSON
    path = []
    node = doc
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        k = data.draw(st.sampled_from(keys))
        path.append(k)
        node = node[k]
    if path:
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = data.draw(json_values)
    try:
        Index.loads(json.dumps(doc).encode(), "fuzz")
    except errors.MoeckptError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzzed_safetensors_headers_raise_only_typed_errors(data):
    from dataclasses import replace

    from moeckpt.formats.checksum import checksum

    index = CheckpointReader(_VALID_LOCATION).index
    entry = index.files["rank-00000.safetensors"]
    with open(os.path.join(_VALID_LOCATION, entry.path), "rb") as f:
        raw = bytearray(f.read())
    (hlen,) = struct.unpack("<Q", raw[:8])
    mode = data.draw(st.sampled_from(["flip", "splice", "length"]))
    if mode == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(8, 8 + hlen - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif mode == "splice":
        i = data.draw(st.integers(8, 8 + hlen - 1))
        junk = data.draw(st.binary(max_size=30))
        raw[i : i + len(junk)] = junk
    else:
        raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    head_len = min(len(raw), 8 + struct.unpack("<Q", raw[:8])[0]) if len(raw) >= 8 else len(raw)
    store = open_storage("memory://fuzz/c")
    store.write_bytes(entry.path, bytes(raw))
    # Record the fuzzed header's checksum as if the index were written for it, so parsing goes past the checksum.
    forged = replace(entry, size=len(raw), checksum=checksum(bytes(raw[:head_len])))
    try:
        read_header(store, forged, index.tensors)
    except errors.MoeckptError:
        pass
