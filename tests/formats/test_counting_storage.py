"""The counting storage (``moeckpt.testing.counting``): the storage contract, and what it counts."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from moeckpt.formats.storages import open_storage, register_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.testing import StorageTests, counting
from moeckpt.trainer.models import presets

_n = itertools.count()


class TestCountingStorage(StorageTests):
    @pytest.fixture
    def storage_location(self) -> str:
        name = f"suite-{os.getpid()}-{next(_n)}"
        yield f"count://{name}/store"
        counting.forget(name)

    def test_kind(self, storage):
        assert type(storage) is counting.CountingStorage and not storage.is_local and not storage.seekable_writes


def test_register_storage_refuses_bad_schemes_and_classes():
    for scheme in ("", "S3", "a/b", None):
        with pytest.raises(ValueError, match="scheme"):
            register_storage(scheme, counting.CountingStorage)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Storage subclass"):
        register_storage("nope", dict)  # type: ignore[arg-type]


def test_it_keeps_no_zeros_and_counts_per_rank_and_directory():
    t = counting.tally("counts-unit")
    s = open_storage("count://counts-unit/run/step-1")
    header = b"\x01header"
    with t.as_rank(3):
        s.write_parts("rank-00000.bin", [header, bytes(1 << 20)])
    with t.as_rank(5):
        assert s.read_range("rank-00000.bin", 0, 7) == header
        assert s.read_range("rank-00000.bin", 7, 1 << 16) == bytes((1 << 16) - 7)
    obj = t.objects["run/step-1/rank-00000.bin"]
    assert obj.size == len(header) + (1 << 20) and sum(len(d) for _, d in obj.segments) <= 1 << 16
    assert t.per_rank[3].write_bytes == obj.size and t.per_rank[3].objects == 1 and t.per_rank[3].write_requests == 1
    assert t.per_rank[5].read_requests == 2 and t.per_rank[5].read_bytes == 1 << 16
    assert t.per_dir["run/step-1"].objects == 1
    counting.forget("counts-unit")


def test_a_save_and_a_resharding_load_of_zeros_through_the_real_writers_and_readers():
    """zaya-tiny saved in tp=1 ep=2 dp=2 to count://, loaded by one rank of tp=2 ep=1 dp=2: checksums verify."""
    spec = presets()["zaya-tiny"]
    tensors = logical_tensors(spec.param_specs(), param_dtype="bfloat16", with_optimizer=True)
    location = "count://sim-unit/step"
    t = counting.tally("sim-unit")
    index = save_full_tensors(
        location,
        tensors=tensors,
        layout=Layout(tp=1, ep=2, dp=2),
        values=lambda e: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)),
        model=spec.to_json(),
    )
    assert t.per_dir["step"].objects == len(index.files) + 1  # the data files and the index
    t.reset_counts()
    stats = LoadStats()
    with t.as_rank(1):
        state = load_rank_state(location, Layout(tp=2, ep=1, dp=2), 1, stats=stats)
    assert state and all(not t.any() for boxes in state.values() for _, t in boxes)
    assert t.per_rank[1].read_bytes >= stats.bytes_read > 0 and set(t.per_rank) == {1}
    counting.forget("sim-unit")
