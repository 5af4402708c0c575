"""The zarr chunk codec off the interpreter lock (formats/backends/chunk_codec.py): the C entry points give the
bytes numcodecs' and google_crc32c's bindings give, the fallback to the bindings writes the same checkpoint, and
the codec pool keeps order, raises the first failure and works again in a forked child."""

from __future__ import annotations

import multiprocessing
import os

import google_crc32c
import numpy as np
import pytest
import torch
from numcodecs import blosc

import moeckpt
from moeckpt.formats.backends import chunk_codec
from moeckpt.formats.backends.zarr_cells import compress_chunk


def _buffers() -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(300_000) * 0.02).astype(np.float32)
    bf16 = torch.from_numpy(w).to(torch.bfloat16).view(torch.uint16).numpy().tobytes()
    return [
        (w.tobytes(), 4),
        (bf16, 2),
        (bytes(1 << 20), 4),  # all zeros: blosc's run-length path
        (rng.integers(0, 256, 777_777, dtype=np.uint8).tobytes(), 1),  # incompressible: stored as is
        (b"x", 1),
    ]


@pytest.fixture
def bindings_only(monkeypatch):
    """The codec as it runs where no C entry point is found (``MOECKPT_NATIVE_CODEC=0``)."""
    monkeypatch.setenv("MOECKPT_NATIVE_CODEC", "0")
    monkeypatch.setattr(chunk_codec, "_native", None)
    yield
    monkeypatch.setattr(chunk_codec, "_native", None)


def test_the_c_entry_points_are_found_on_this_platform():
    assert chunk_codec.uses_native() == {"crc32c": True, "blosc": True}


@pytest.mark.parametrize("case", range(len(_buffers())))
def test_native_frames_and_checksums_equal_the_bindings(case):
    raw, item = _buffers()[case]
    frame = chunk_codec.blosc_compress(raw, "zstd", 1, blosc.SHUFFLE, 1 << 20, item)
    assert bytes(frame) == blosc.compress(raw, b"zstd", 1, blosc.SHUFFLE, 1 << 20, item)
    assert chunk_codec.crc32c_int(raw) == google_crc32c.value(raw)
    assert chunk_codec.crc32c_int(memoryview(raw)[1:]) == google_crc32c.value(raw[1:])
    out = np.empty(len(raw), dtype=np.uint8)
    chunk_codec.blosc_decompress_into(frame, out)
    assert out.tobytes() == raw


def test_the_bindings_give_the_same_chunk_bytes(bindings_only):
    assert chunk_codec.uses_native() == {"crc32c": False, "blosc": False}
    raw, item = _buffers()[1]
    via_bindings = [bytes(p) for p in compress_chunk(memoryview(raw), item)]
    chunk_codec._native = None
    os.environ["MOECKPT_NATIVE_CODEC"] = "1"
    assert chunk_codec.uses_native()["blosc"]
    assert [bytes(p) for p in compress_chunk(memoryview(raw), item)] == via_bindings


def test_a_decode_of_a_damaged_frame_is_an_error_either_way(bindings_only):
    raw, item = _buffers()[0]
    frame = bytearray(blosc.compress(raw, b"zstd", 1, blosc.SHUFFLE, 1 << 20, item))
    frame[40:48] = b"\xff" * 8
    for native in ("0", "1"):
        os.environ["MOECKPT_NATIVE_CODEC"] = native
        chunk_codec._native = None
        with pytest.raises((RuntimeError, ValueError)):
            chunk_codec.blosc_decompress_into(frame, np.empty(len(raw), dtype=np.uint8))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1500, 1000, generator=g) * 0.02  # 6 MB of fp32: a sharded cell of several inner chunks
    return {"w": w.to(torch.bfloat16), "master/w": w, "b": torch.randn(7, generator=g)}


def _files(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def test_a_checkpoint_written_through_the_bindings_is_byte_equal_and_reads_both_ways(tmp_path, bindings_only):
    state = _state()
    moeckpt.save(state, tmp_path / "bindings", format="zarr", compress="blosc-zstd")
    chunk_codec._native = None
    os.environ["MOECKPT_NATIVE_CODEC"] = "1"
    moeckpt.save(state, tmp_path / "native", format="zarr", compress="blosc-zstd")
    assert _files(tmp_path / "bindings") == _files(tmp_path / "native")
    for native in ("1", "0"):
        os.environ["MOECKPT_NATIVE_CODEC"] = native
        chunk_codec._native = None
        got = {k: torch.empty_like(v) for k, v in state.items()}
        moeckpt.load(got, tmp_path / "native")
        assert all(torch.equal(got[k], state[k]) for k in state)


def test_the_codec_pool_keeps_order_and_raises_the_first_failure():
    assert list(chunk_codec.codec_map(lambda x: x * x, range(100))) == [x * x for x in range(100)]

    def fail_at_7(x: int) -> int:
        if x == 7:
            raise ValueError("seven")
        return x

    with pytest.raises(ValueError, match="seven"):
        list(chunk_codec.codec_map(fail_at_7, range(50)))


def test_a_pool_of_one_thread_runs_in_the_caller(monkeypatch):
    monkeypatch.setattr(chunk_codec, "codec_threads", lambda: 1)
    import threading

    me = threading.get_ident()
    assert set(chunk_codec.codec_map(lambda _: threading.get_ident(), range(5))) == {me}


def test_the_pool_size_is_the_ranks_share_of_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert chunk_codec.codec_threads() == min(chunk_codec.CODEC_THREADS_MAX, cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 4))
    assert chunk_codec.codec_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert chunk_codec.codec_threads() == min(chunk_codec.CODEC_THREADS_MAX, cores)


def _child(queue) -> None:
    queue.put(list(chunk_codec.codec_map(lambda x: x + 1, range(20))))


def test_a_forked_child_gets_a_pool_of_its_own(monkeypatch):
    monkeypatch.setattr(chunk_codec, "codec_threads", lambda: 2)
    list(chunk_codec.codec_map(lambda x: x, range(10)))  # the parent's pool exists (its threads do not fork)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    assert queue.get(timeout=60) == list(range(1, 21))
    proc.join(timeout=60)
    assert proc.exitcode == 0
