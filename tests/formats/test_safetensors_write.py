"""The streaming safetensors writer produces exactly the reference encoding, for every kind of piece a trainer hands it.

Trainers pass views of their local tensors (one block of a fused gate/up split along dim 1 is strided), pieces
larger than a checksum block, scalars and bf16; the bytes on disk must not depend on any of that.
"""

from __future__ import annotations

import pytest
import torch

from moeckpt.formats.backends import safetensors as st
from moeckpt.formats.backends.piece_stream import WritebackKick
from moeckpt.formats.box import Box
from moeckpt.formats.checksum import checksum
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES, Piece
from moeckpt.formats.storages import open_storage


def _entry(name: str, shape: tuple[int, ...], dtype: str) -> TensorEntry:
    return TensorEntry(name=name, shape=shape, dtype=dtype, role="param", param=name)


def _pieces() -> tuple[list[Piece], dict[str, TensorEntry]]:
    g = torch.Generator().manual_seed(0)
    big_rows = _entry("fused_big", (3, 2 * 300, 512), "float32")  # strided rows of 600 KB: written directly
    small_rows = _entry("fused_small", (5, 2 * 8, 64), "bfloat16")  # strided rows of 1 KB: gathered first
    large = _entry("large", (CHECKSUM_BLOCK_BYTES // 4 * 2 + 1000,), "float32")  # spans three checksum blocks
    scalar = _entry("scalar", (), "float32")
    empty = _entry("empty", (0, 4), "float32")
    inner = _entry("inner", (2, 300, 512), "float32")  # split along the last dim: rows of rows
    transposed = _entry("transposed", (64, 48), "bfloat16")  # a transposed view: no contiguous rows at all
    tensors = {e.name: e for e in (big_rows, small_rows, large, scalar, empty, inner, transposed)}
    fb = torch.randn(big_rows.shape, generator=g)
    fs = torch.randn(small_rows.shape, generator=g).to(torch.bfloat16)
    pieces = [
        Piece("fused_big", Box((0, 0, 0), (3, 300, 512)), fb.narrow(1, 0, 300)),
        Piece("fused_big", Box((0, 300, 0), (3, 300, 512)), fb.narrow(1, 300, 300)),
        Piece("fused_small", Box((0, 8, 0), (5, 8, 64)), fs.narrow(1, 8, 8)),
        Piece("fused_small", Box((0, 0, 0), (5, 8, 64)), fs.narrow(1, 0, 8)),
        Piece("large", Box((0,), large.shape), torch.randn(large.shape, generator=g)),
        Piece("scalar", Box((), ()), torch.tensor(3.5)),
        Piece("empty", Box((0, 0), (0, 4)), torch.empty(0, 4)),
        Piece("inner", Box((0, 0, 256), (2, 300, 256)), torch.randn(inner.shape, generator=g).narrow(2, 256, 256)),
        Piece("transposed", Box((0, 0), (64, 48)), torch.randn(48, 64, generator=g).to(torch.bfloat16).t()),
    ]
    return pieces, tensors


def _reference(pieces, tensors) -> bytes:
    head, buffers = st.encode(pieces, tensors)
    return head + b"".join(bytes(b) for b in buffers)


def test_local_write_equals_reference_encoding(tmp_path):
    pieces, tensors = _pieces()
    storage = open_storage(str(tmp_path))
    entry = st.write_file(storage, "rank-00000.safetensors", pieces, tensors)
    data = (tmp_path / "rank-00000.safetensors").read_bytes()
    assert data == _reference(pieces, tensors)
    assert entry.size == len(data)
    head_len = 8 + int.from_bytes(data[:8], "little")
    assert entry.checksum == checksum(data[:head_len])


@pytest.mark.parametrize("threads", [2, 5])
def test_parallel_local_write_equals_reference_encoding(tmp_path, threads):
    """The memory tier's write: every piece hashed and written at its offset by its own thread, same bytes."""
    pieces, tensors = _pieces()
    storage = open_storage(str(tmp_path))
    entry = st.SafetensorsBackend().write(storage, 0, pieces, tensors, threads=threads)[0]
    data = (tmp_path / "rank-00000.safetensors").read_bytes()
    assert data == _reference(pieces, tensors)
    assert entry.size == len(data) and entry.path == "rank-00000.safetensors"
    assert entry.checksum == checksum(data[: 8 + int.from_bytes(data[:8], "little")])


def test_parallel_write_elsewhere_is_the_streamed_one():
    pieces, tensors = _pieces()
    storage = open_storage("memory://moeckpt-tests/parallel-write")
    st.write_file_parallel(storage, "rank-00000.safetensors", pieces, tensors, threads=4)
    assert storage.read_bytes("rank-00000.safetensors") == _reference(pieces, tensors)
    storage.remove()


def test_remote_write_equals_reference_encoding():
    pieces, tensors = _pieces()
    storage = open_storage("memory://moeckpt-tests/streaming-write")
    st.write_file(storage, "rank-00000.safetensors", pieces, tensors)
    assert storage.read_bytes("rank-00000.safetensors") == _reference(pieces, tensors)
    storage.remove()


def test_written_pieces_read_back(tmp_path):
    pieces, tensors = _pieces()
    storage = open_storage(str(tmp_path))
    entry = st.write_file(storage, "f.safetensors", pieces, tensors)
    refs = st.list_pieces(storage, [entry], tensors)
    by_key = {(r.tensor, r.box.offsets): r for r in refs}
    for p in pieces:
        if p.box.is_empty():
            continue
        got = st.read_piece(storage, by_key[(p.tensor, p.box.offsets)])
        assert torch.equal(got, p.data)


def test_early_writeback_keeps_the_bytes(tmp_path, monkeypatch):
    # Kick the writeback after every few KiB (normally every 32 MiB), so that it runs many times on a small file.
    monkeypatch.setattr(WritebackKick, "EVERY", 4096)
    pieces, tensors = _pieces()
    storage = open_storage(str(tmp_path))
    st.write_file(storage, "rank-00000.safetensors", pieces, tensors)
    assert (tmp_path / "rank-00000.safetensors").read_bytes() == _reference(pieces, tensors)
