"""An export that moves bytes unchanged reads them without torch: the same files as the torch path, every byte
verified, and a process that cannot import torch exports all the same."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader, byte_view
from moeckpt.formats.errors import ChecksumMismatchError

# Runs the moeckpt command in a process where importing torch fails, as if it were not installed.
WITHOUT_TORCH = """
import runpy, sys
class NoTorch:
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not importable in this test")
sys.meta_path.insert(0, NoTorch())
sys.argv = ["moeckpt", *sys.argv[1:]]
runpy.run_module("moeckpt.cli.main", run_name="__main__")
"""


def _files(directory) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def _init(cli, out, preset, *args) -> str:
    code, _, err = cli("init", out, "--model", preset, *args)
    assert code == 0, err
    return str(out)


@pytest.mark.parametrize(
    "preset, layout",
    [
        ("qwen3moe-tiny", ("--tp", "2", "--ep", "2", "--dp", "2")),  # TP columns, expert halves, fused experts
        ("deepseekv3-tiny", ("--tp", "2", "--ep", "2", "--dp", "2", "--dtype", "bf16")),
        ("zaya-tiny", ("--tp", "1", "--ep", "1", "--dp", "1")),
    ],
)
def test_export_without_torch_writes_what_the_torch_path_writes(tmp_path, moeckpt_cli, monkeypatch, preset, layout):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", preset, *layout)
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "export-hf", ckpt, str(tmp_path / "bytes"), "--max-shard-size", "200KB"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    # the torch path: every byte read refused, so each tensor goes through read_tensor and torch
    monkeypatch.setattr(CheckpointReader, "read_bytes", lambda self, name, out, session: False)
    code, _, err = moeckpt_cli("export-hf", ckpt, tmp_path / "torch", "--max-shard-size", "200KB")
    assert code == 0, err
    bytes_path, torch_path = _files(tmp_path / "bytes"), _files(tmp_path / "torch")
    assert len([n for n in bytes_path if n.endswith(".safetensors")]) > 1
    assert bytes_path == torch_path


def test_read_bytes_is_read_tensor_as_bytes_for_every_tensor(tmp_path, moeckpt_cli):
    ckpt = _init(
        moeckpt_cli, tmp_path / "ck", "qwen3moe-tiny", "--tp", "2", "--ep", "2", "--dp", "2", "--dtype", "bf16"
    )
    reader = CheckpointReader(ckpt)
    session = reader.open_reader()
    try:
        strided = 0
        for name, entry in reader.index.tensors.items():
            out = np.full(entry.nbytes, 0xAB, dtype=np.uint8)
            assert reader.read_bytes(name, out, session)
            want = reader.read_tensor(name).contiguous().reshape(-1).view(torch.uint8).numpy()
            assert np.array_equal(out, want), name
            strided += any(r.tensor == name and r.box.shape[-1:] != entry.shape[-1:] for r in reader.pieces())
        assert strided  # some tensors were joined from column halves, not only from whole rows
    finally:
        session.close()


def test_read_bytes_verifies_what_it_reads(tmp_path, moeckpt_cli):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", "qwen3moe-tiny", "--tp", "2")
    reader = CheckpointReader(ckpt)
    # one piece read straight into place (whole rows) and one verified over a mapping (a column half), each damaged
    pieces = reader.pieces()
    whole = next(r for r in pieces if r.box.ndim and r.box.shape[1:] == reader.index.tensors[r.tensor].shape[1:])
    half = next(r for r in pieces if r.box.ndim == 2 and r.box.shape[1] != reader.index.tensors[r.tensor].shape[1])
    for ref in (whole, half):
        path = os.path.join(ckpt, ref.file)
        with open(path, "r+b") as f:
            f.seek(ref.start + ref.nbytes // 2)
            b = f.read(1)
            f.seek(ref.start + ref.nbytes // 2)
            f.write(bytes([b[0] ^ 0x01]))
        damaged = CheckpointReader(ckpt)
        session = damaged.open_reader()
        try:
            out = np.empty(damaged.index.tensors[ref.tensor].nbytes, dtype=np.uint8)
            with pytest.raises(ChecksumMismatchError, match=ref.file):
                damaged.read_bytes(ref.tensor, out, session)
        finally:
            session.close()
        with open(path, "r+b") as f:  # mended for the next
            f.seek(ref.start + ref.nbytes // 2)
            f.write(b)


def test_read_bytes_declines_a_session_that_neither_reads_into_memory_nor_maps(tmp_path, moeckpt_cli):
    ckpt = _init(moeckpt_cli, tmp_path / "ck", "zaya-tiny", "--format", "zarr")
    reader = CheckpointReader(ckpt)
    name, entry = next(iter(reader.index.tensors.items()))
    session = reader.open_reader()
    try:
        assert reader.read_bytes(name, np.empty(entry.nbytes, dtype=np.uint8), session) is False
    finally:
        session.close()
    with pytest.raises(ValueError, match="contiguous uint8"):
        reader.read_bytes(name, np.empty(entry.nbytes + 1, dtype=np.uint8), session)


def test_byte_view_cuts_any_dtype_along_its_leading_dimensions():
    values = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2, 6, 3)
    view = byte_view(values.reshape(-1).view(np.uint8), values.shape, 4)
    assert view.shape == (2, 6, 12)
    np.testing.assert_array_equal(view[1, 2:4].reshape(-1).view(np.float32), values[1, 2:4].reshape(-1))
    assert byte_view(np.zeros(2, dtype=np.uint8), (), 2).shape == (2,)
