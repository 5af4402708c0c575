"""A DCP checkpoint is read without running any of its pickles: hostile, truncated and garbage files are refused
with one line, and the reader agrees with torch's own loader on honest files."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import struct
import time
import zipfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moeckpt.formats.dcp import (
    DcpFormatError,
    UnsafePickleError,
    open_dcp,
    parse_metadata,
)
from moeckpt.formats.dcp.unpickler import load_payload_pickle
from moeckpt.formats.errors import UnsafePathError


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _save(path, sd) -> str:
    with pytest.warns(UserWarning):  # single-process dcp.save warns that it runs without a process group
        dcp.save(sd, checkpoint_id=str(path))
    return str(path)


@pytest.fixture
def honest(tmp_path) -> str:
    sd = {
        "a": torch.arange(12.0).reshape(3, 4),
        "b": {"c": torch.ones(2, dtype=torch.bfloat16)},
        "step": 5,
        "name": "x",
        "lr": 1.5,
        "sizes": [1, 2],
        "e": torch.empty(0, 3),
    }
    return _save(tmp_path / "honest", sd)


class _Run:
    """Pickles to a call of ``fn(*args)``: what a hostile .metadata would carry."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_reader_matches_torch_loader(honest):
    ck = open_dcp(honest)
    sd = {"a": torch.zeros(3, 4), "b": {"c": torch.zeros(2, dtype=torch.bfloat16)}, "e": torch.zeros(0, 3)}
    dcp.load(sd, checkpoint_id=honest, no_dist=True)
    assert torch.equal(ck.read_tensor("a"), sd["a"])
    assert torch.equal(ck.read_tensor("b.c"), sd["b"]["c"])
    assert ck.read_tensor("e").shape == (0, 3)
    assert {k: ck.read_value(k) for k in ck.values} == {"step": 5, "name": "x", "lr": 1.5, "sizes": [1, 2]}


def test_hostile_metadata_runs_nothing(tmp_path, honest, moeckpt_cli):
    marker = tmp_path / "pwned"
    for payload in (
        _Run(os.system, f"touch {marker}"),
        _Run(eval, f"open({str(marker)!r}, 'w')"),
        _Run(getattr, "os", "system"),
    ):
        with open(os.path.join(honest, ".metadata"), "wb") as f:
            pickle.dump({"state_dict_metadata": payload}, f)
        with pytest.raises(UnsafePickleError, match="refusing to unpickle .* from .metadata: not a DCP metadata class"):
            open_dcp(honest)
        code, _, err = moeckpt_cli("import-dcp", honest, tmp_path / "dst")
        assert code == 2 and err.count("\n") == 1 and "refusing to unpickle" in err, err
        assert not marker.exists()
        assert not (tmp_path / "dst").exists()


def test_admitted_classes_cannot_be_called_with_arguments(honest):
    from torch.distributed.checkpoint.metadata import Metadata

    # REDUCE(Metadata, (...)) instead of NEWOBJ + BUILD: DCP never writes it, and a stand-in refuses arguments.
    bad = _Run(Metadata, {"x": 1})
    with pytest.raises(UnsafePickleError, match="called with arguments"):
        parse_metadata(pickle.dumps(bad), "test")
    with pytest.raises(UnsafePickleError, match="torch.Size"):
        parse_metadata(pickle.dumps(_Run(torch.Size, ("rm -rf",))), "test")
    with pytest.raises(UnsafePickleError, match="refusing to unpickle torch._utils._rebuild_tensor_v2 from .metadata"):
        parse_metadata(pickle.dumps(torch.ones(2)), "test")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "not-metadata"])
def test_broken_metadata_is_one_line(honest, tmp_path, moeckpt_cli, damage):
    path = os.path.join(honest, ".metadata")
    raw = _read(path)
    new = {
        "truncate": raw[: len(raw) // 2],
        "garbage": os.urandom(len(raw)),
        "empty": b"",
        "not-metadata": pickle.dumps({"a": [1, 2]}),
    }[damage]
    _write(path, new)
    with pytest.raises((UnsafePickleError, DcpFormatError)):
        open_dcp(honest)
    code, _, err = moeckpt_cli("import-dcp", honest, tmp_path / "dst")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def _distcp(honest) -> str:
    return os.path.join(honest, "__0_0.distcp")


def test_truncated_data_file_is_refused_before_writing(honest, tmp_path, moeckpt_cli):
    path = _distcp(honest)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(DcpFormatError, match="truncated"):
        open_dcp(honest)
    code, _, err = moeckpt_cli("import-dcp", honest, tmp_path / "dst")
    assert code == 2 and "truncated" in err and err.count("\n") == 1
    assert not (tmp_path / "dst").exists() and not (tmp_path / ".dst.partial").exists()


def test_garbage_data_file_is_refused(honest, tmp_path, moeckpt_cli):
    path = _distcp(honest)
    size = os.path.getsize(path)
    _write(path, os.urandom(size))
    ck = open_dcp(honest)  # sizes still match: the damage shows when a chunk is located
    with pytest.raises(DcpFormatError):
        ck.chunks()
    code, _, err = moeckpt_cli("import-dcp", honest, tmp_path / "dst")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "dst").exists()


def _torch_save(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _replace_pickle(archive: bytes, new_pickle: bytes) -> bytes:
    """The same torch.save archive with its data.pkl replaced (what a hostile writer controls)."""
    src = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = new_pickle if info.filename.endswith("data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, data)
    return out.getvalue()


def _bomb(depth: int = 40) -> bytes:
    """A 'billion laughs' pickle: each level is a list holding the previous level ten times (by memo reference),
    so it is a few hundred bytes but expands to 10**depth elements once walked."""
    ops = [b"\x80\x02", b"]", b"q\x00"]  # PROTO 2, EMPTY_LIST, BINPUT 0
    for i in range(1, depth + 1):
        # EMPTY_LIST, BINPUT i, MARK, BINGET (i - 1) ten times, APPENDS
        ops.append(b"]q" + bytes([i]) + b"(" + (b"h" + bytes([i - 1])) * 10 + b"e")
    ops.append(b".")
    return b"".join(ops)


def test_payload_pickle_bomb_and_hostile_payload_are_refused(honest, tmp_path):
    from moeckpt.formats.dcp.payload import locate_tensor

    marker = tmp_path / "pwned"
    arch = _torch_save(torch.arange(12.0).reshape(3, 4))
    hostile = pickle.dumps(_Run(os.system, f"touch {marker}"))
    assert not isinstance(load_payload_pickle(_bomb(), "payload"), tuple)  # lists by reference: no expansion
    with pytest.raises(UnsafePickleError, match="refusing to unpickle posix.system from a tensor payload"):
        load_payload_pickle(hostile, "payload")
    for bad in (_bomb(), hostile, b"\x80\x02K\x05.", b"\x80\x02" + b"(" * 100_000):
        item = _replace_pickle(arch, bad)
        started = time.perf_counter()
        with pytest.raises((UnsafePickleError, DcpFormatError)):
            locate_tensor(lambda a, b, item=item: item[a:b], len(item), (3, 4), "float32", "item")
        assert time.perf_counter() - started < 2
    # The same payloads inside a real .distcp file: the reader locates the record, refuses it, runs nothing.
    for bad in (_bomb(), hostile):
        ck_dir = tmp_path / f"ck{len(bad)}"
        shutil.copytree(honest, ck_dir)
        item = _replace_pickle(arch, bad)
        offset = os.path.getsize(ck_dir / "__0_0.distcp")
        with open(ck_dir / "__0_0.distcp", "ab") as f:
            f.write(item)
        _point(ck_dir, "a", offset, len(item))
        with pytest.raises((UnsafePickleError, DcpFormatError)):
            open_dcp(str(ck_dir)).chunks(["a"])
    assert not marker.exists()


def _point(ck_dir, name: str, offset: int, length: int) -> None:
    """Rewrite .metadata so tensor ``name``'s item is at ``offset`` (torch's own classes: a test may pickle)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = FileSystemReader(str(ck_dir)).read_metadata()
    for key, info in list(md.storage_data.items()):
        if key.fqn == name:
            md.storage_data[key] = _StorageInfo(info.relative_path, offset, length)
    md.storage_meta = None
    with open(ck_dir / ".metadata", "wb") as f:
        pickle.dump(md, f)


def test_value_bomb_for_torch_load_is_refused(tmp_path):
    from moeckpt.formats.dcp.payload import decode_value

    bomb_value = _replace_pickle(_torch_save([1, 2]), _bomb(12))
    started = time.perf_counter()
    with pytest.raises(DcpFormatError, match="pickle bomb"):
        decode_value(bomb_value, "value")
    assert time.perf_counter() - started < 5
    with pytest.raises(DcpFormatError, match="weights-only"):
        decode_value(_replace_pickle(_torch_save([1]), pickle.dumps(_Run(os.system, "true"))), "value")


@pytest.mark.parametrize("path", ["../evil.distcp", "/etc/passwd", "a/../../b", "s3://bucket/x", "c:\\x"])
def test_storage_paths_cannot_escape(honest, tmp_path, moeckpt_cli, path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = FileSystemReader(honest).read_metadata()
    key = next(iter(md.storage_data))
    info = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(path, info.offset, info.length)
    md.storage_meta = None
    with open(os.path.join(honest, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(UnsafePathError):
        open_dcp(honest)
    code, _, err = moeckpt_cli("import-dcp", honest, tmp_path / "dst")
    assert code == 2 and "not a plain relative path" in err and err.count("\n") == 1


def test_chunks_must_cover_their_tensor(honest):
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(honest).read_metadata()
    md.state_dict_metadata["a"].chunks.pop()
    md.storage_meta = None
    with open(os.path.join(honest, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(DcpFormatError, match="cover it exactly once"):
        open_dcp(honest)


def test_zip_offsets_are_checked():
    from moeckpt.formats.dcp.payload import locate_tensor

    arch = bytearray(_torch_save(torch.arange(12.0).reshape(3, 4)))
    eocd = arch.rfind(b"PK\x05\x06")
    struct.pack_into("<I", arch, eocd + 16, len(arch) + 10)  # central directory "after" the end
    with pytest.raises(DcpFormatError, match="outside"):
        locate_tensor(lambda a, b: bytes(arch[a:b]), len(arch), (3, 4), "float32", "item")
    good = _torch_save(torch.arange(12.0).reshape(3, 4))
    with pytest.raises(DcpFormatError, match="shape"):
        locate_tensor(lambda a, b: good[a:b], len(good), (4, 3), "float32", "item")
    with pytest.raises(DcpFormatError, match="bfloat16"):
        locate_tensor(lambda a, b: good[a:b], len(good), (3, 4), "bfloat16", "item")


def test_a_strided_view_is_refused_with_the_fix(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    path = _save(tmp_path / "views", {"t": w.t(), "cols": w[:, 1:3]})
    ck = open_dcp(path)
    assert torch.equal(ck.read_tensor("cols"), w[:, 1:3])  # a slice is cloned compact by DCP: fine
    with pytest.raises(DcpFormatError, match=r"strided view .* save .contiguous\(\) tensors"):
        ck.read_tensor("t")
