"""The export's read-ahead: one logical tensor read ahead on its own thread, two buffers in turn, errors where asked."""

from __future__ import annotations

import threading

import pytest
import torch

from moeckpt.formats.checkpoint import ReusedBuffer
from moeckpt.trainer.hf_export import ReadAhead


def test_reads_the_next_tensor_while_the_caller_writes_and_alternates_two_buffers():
    started: dict[str, threading.Event] = {n: threading.Event() for n in "abc"}
    buffers: dict[str, ReusedBuffer] = {}
    threads: set[int] = set()

    def read(name: str, scratch: ReusedBuffer) -> dict[str, torch.Tensor]:
        started[name].set()
        buffers[name] = scratch
        threads.add(threading.get_ident())
        return {name: scratch.get((4,), torch.float32).fill_(ord(name))}

    with ReadAhead(["a", "b", "c"], read) as ahead:
        assert ahead.next("a")["a"].tolist() == [ord("a")] * 4
        # b's read started when a was handed out, before anyone asked for it
        assert started["b"].wait(10)
        assert not started["c"].is_set()
        assert ahead.next("b")["b"].tolist() == [ord("b")] * 4
        assert ahead.next("c")["c"].tolist() == [ord("c")] * 4
    assert buffers["a"] is buffers["c"] and buffers["a"] is not buffers["b"]
    assert threads and threading.get_ident() not in threads


def test_a_failed_read_is_raised_by_the_next_that_asks_for_it():
    def read(name: str, scratch: ReusedBuffer) -> dict[str, torch.Tensor]:
        if name == "b":
            raise OSError("b is damaged")
        return {name: torch.zeros(1)}

    with ReadAhead(["a", "b", "c"], read) as ahead:
        ahead.next("a")  # b's failure is not a's
        with pytest.raises(OSError, match="b is damaged"):
            ahead.next("b")


def test_asking_out_of_order_is_a_bug_it_names():
    with ReadAhead(["a", "b"], lambda n, s: {n: torch.zeros(1)}) as ahead:
        with pytest.raises(RuntimeError, match="expected \\['a'\\]"):
            ahead.next("b")


def test_a_reserved_buffer_is_taken_once_at_the_largest_size():
    """Reads growing one after another land in the memory the first one took (its pages faulted in once)."""
    grown, reserved = ReusedBuffer(), ReusedBuffer(reserve=1 << 20)
    first = reserved.get_bytes(10).ctypes.data
    assert all(reserved.get_bytes(n).ctypes.data == first for n in (100, 1 << 16, 1 << 20))
    assert len(reserved.get_bytes(1 << 20)) == 1 << 20
    grown.get_bytes(10)
    assert len(grown.get_bytes(1 << 20)) == 1 << 20  # without a reserve it grows as asked
    assert reserved.get_bytes(2 << 20).nbytes == 2 << 20  # and past the reserve too
