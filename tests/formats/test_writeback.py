"""Starting a save's writeback early: sync_file_range on Linux, the fadvise fallback, and files that take neither."""

from __future__ import annotations

import os
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file

from moeckpt.formats import writeback
from moeckpt.formats.backends.safetensors_write import write_file
from moeckpt.formats.box import Box
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storages.local import LocalStorage


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_starts_writeback_with_sync_file_range(tmp_path):
    assert writeback._SYNC is not None
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 100_000)
        assert writeback.start_writeback(fd, 0, 100_000)
    finally:
        os.close(fd)


def test_without_sync_file_range_fadvise_starts_it_and_a_pipe_takes_no_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(writeback, "_SYNC", None)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"x" * 10_000)
        assert writeback.start_writeback(fd, 0, 10_000) == hasattr(os, "posix_fadvise")
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert not writeback.start_writeback(w, 0, 10)
    finally:
        os.close(r)
        os.close(w)


def test_a_file_that_refuses_the_hint_is_still_saved(tmp_path, monkeypatch):
    """Every hint failing (a filesystem that supports neither): the save goes on, the same bytes."""
    calls = []

    def refused(fd, offset, length):
        calls.append(length)
        return False

    monkeypatch.setattr(writeback, "start_writeback", refused)
    data = torch.arange(24 << 20, dtype=torch.float32)  # 96 MiB: past the first hint
    entry = TensorEntry(name="t", shape=tuple(data.shape), dtype="float32", role="param", param="t", sharding={})
    storage = LocalStorage(str(tmp_path))
    got = write_file(storage, "a.safetensors", [Piece("t", Box.full(entry.shape), data)], {"t": entry})
    assert len(calls) == 1  # asked once, then no more
    assert got.size == os.path.getsize(tmp_path / "a.safetensors")
    (stored,) = load_file(str(tmp_path / "a.safetensors")).values()  # the one piece, under its piece key
    assert torch.equal(stored, data)


def test_ranges_are_started_in_the_background_in_order_and_close_waits_for_them(monkeypatch):
    seen = []
    monkeypatch.setattr(
        writeback, "start_writeback", lambda fd, offset, length: seen.append((fd, offset, length)) or True
    )
    with writeback.Writeback(7) as wb:
        for k in range(5):
            wb.start(k * 10, 10)
    assert seen == [(7, k * 10, 10) for k in range(5)]  # all of them started before the block was left
    with writeback.Writeback(None) as idle:  # no file: nothing runs
        idle.start(0, 10)
    assert idle._thread is None and len(seen) == 5


def test_write_threads_share_the_hosts_cores_between_its_ranks(monkeypatch):
    from moeckpt.reshard.save_protocol import MAX_WRITE_THREADS, write_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert write_threads() == min(MAX_WRITE_THREADS, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert write_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # more ranks than cores: one each
    assert write_threads() == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert write_threads() == MAX_WRITE_THREADS  # one process alone


def test_a_parallel_write_is_the_same_file_as_a_streamed_one(tmp_path):
    from moeckpt.formats.backends.safetensors_write import write_file_parallel

    pieces, tensors = [], {}
    for i, n in enumerate([3 << 20, 10, 2 << 20, 5]):  # large pieces (their writeback started) and small ones
        t = torch.randn(n, generator=torch.Generator().manual_seed(i))
        tensors[f"t{i}"] = TensorEntry(
            name=f"t{i}", shape=(n,), dtype="float32", role="param", param=f"t{i}", sharding={}
        )
        pieces.append(Piece(f"t{i}", Box.full((n,)), t))
    storage = LocalStorage(str(tmp_path))
    a = write_file(storage, "a.safetensors", pieces, tensors)
    b = write_file_parallel(storage, "b.safetensors", pieces, tensors, 3)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert (a.size, a.checksum) == (b.size, b.checksum)


def test_hf_shards_start_their_writeback_as_they_grow_and_keep_their_bytes(tmp_path, monkeypatch):
    """export-hf's and consolidate's shards start their writeback every so many bytes, as a checkpoint's files do,
    so the fsync that closes a shard waits for its tail only; the bytes are what the producer gave, and a storage
    that is not local disk is not asked."""
    from moeckpt.formats.backends.piece_stream import WritebackKick
    from moeckpt.formats.hf_shards import ShardTensor, pack_shards, write_shards

    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(writeback, "start_writeback", lambda fd, offset, length: seen.append((offset, length)) or True)
    tensors = [ShardTensor(f"t{i}", "uint8", (20 << 20,)) for i in range(4)]  # 80 MiB: past two hints
    parts = {t.name: bytes([i]) * t.nbytes for i, t in enumerate(tensors)}

    def produce(t: ShardTensor):
        mv = memoryview(parts[t.name])
        for at in range(0, len(mv), 3 << 20):  # in parts, as the export yields them
            yield mv[at : at + (3 << 20)]

    written = write_shards(str(tmp_path / "hf"), pack_shards(tensors, 10**9), produce)
    (name,) = written.files
    with open(tmp_path / "hf" / name, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        assert f.read() == b"".join(parts[t.name] for t in tensors)
    assert len(seen) == (80 << 20) // WritebackKick.EVERY
    assert seen[0][0] == 8 + n and all(a + la == b for (a, la), (b, _) in zip(seen, seen[1:]))  # in order, no gaps
    assert all(length >= WritebackKick.EVERY for _, length in seen)
    seen.clear()
    write_shards(f"memory://moeckpt-tests/hf-writeback-{os.getpid()}", pack_shards(tensors, 10**9), produce)
    assert not seen
