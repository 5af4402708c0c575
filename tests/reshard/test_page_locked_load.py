"""Device loads that copy whole stored rows straight from page-locked mappings of their files, run on the CPU.

On a CUDA machine the driver page-locks a shared read-only mapping of each part and the copy to the device reads
the page cache itself (:mod:`moeckpt.reshard.page_lock`). Here host tensors are loaded as device tensors are
(``STAGE_HOST_MEMORY``) and the driver is a stand-in that checks what it is asked to lock (a page-aligned,
shared, read-only mapping, never locked twice) and that every lock is released; the bytes that land are checked
against the saved tensors for every layout class, with refusals, corruption and the switch that turns it off.
"""

from __future__ import annotations

import mmap
import re
import threading
import types

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES
from moeckpt.reshard import page_lock, staging
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import LoadOptions
from moeckpt.trainer.models import presets

from ..helpers import flip_byte
from ..reshard_models import save_model
from .test_staged_load import CASES, _load_into_out

#: parts small enough that zaya-tiny's matrices are read in several mapped parts, not coalesced into runs
SMALL = LoadOptions(stage_bytes=4096, mapped_bytes=16384)


def _mapping_of(address: int) -> str:
    """The permissions of the mapping of this process that holds ``address`` (``/proc/self/maps``; the kernel
    may show neighbouring mappings of one file as one)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return perms
    return ""


class FakeDriver:
    """A registrar that checks what it locks and keeps count; ``refuse_after`` refuses every call from then."""

    def __init__(self, refuse_after: int | None = None):
        self.live: dict[int, int] = {}
        self.calls = 0
        self.granted = 0
        self.refuse_after = refuse_after
        self.lock = threading.Lock()

    def register(self, address: int, nbytes: int) -> bool:
        assert address % mmap.PAGESIZE == 0, "a registration starts at a page"
        assert _mapping_of(address) == "r--s", "a shared read-only mapping (the page cache's pages, no copy)"
        with self.lock:
            self.calls += 1
            if self.refuse_after is not None and self.calls > self.refuse_after:
                return False
            assert address not in self.live, "locked twice"
            self.live[address] = nbytes
            self.granted += 1
        return True

    def unregister(self, address: int) -> None:
        with self.lock:
            del self.live[address]


@pytest.fixture
def driver(monkeypatch):
    monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    fake = FakeDriver()
    monkeypatch.setattr(page_lock, "registrar_for", lambda device: fake)
    return fake


def _check_landed(values, out, state) -> None:
    for name, boxes in state.items():
        for box, got in boxes:
            assert got is out[(name, box)], name
            assert torch.equal(got, values[name][box.slices()]), (name, box)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_layout_class_lands_exactly_from_locked_mappings_and_every_lock_is_released(tmp_path, driver, case):
    (st, se, sd), (tt, te, td), rank = CASES[case]
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=st, ep=se, dp=sd))
    _, out, state, stats = _load_into_out(str(tmp_path / "a"), Layout(tp=tt, ep=te, dp=td), rank, SMALL)
    _check_landed(values, out, state)
    assert driver.granted > 10, "whole rows were copied from locked mappings"
    assert not driver.live, "every lock released"
    assert stats.bytes_read <= 1.05 * stats.bytes_needed + len(state) * 4 * 1024 * 1024


def test_a_refusal_turns_the_locked_copies_off_and_the_rest_stages(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    fake = FakeDriver(refuse_after=5)
    monkeypatch.setattr(page_lock, "registrar_for", lambda device: fake)
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=2, dp=2))
    _, out, state, _ = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, SMALL)
    _check_landed(values, out, state)
    assert fake.granted == 5 and not fake.live
    # parts already in flight on other fill threads may ask once each; none asks after it has seen the refusal
    assert fake.calls <= 5 + SMALL.fill_threads


def test_a_flipped_byte_in_a_locked_part_is_caught_before_it_lands_and_nothing_stays_locked(tmp_path, driver):
    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=1, dp=1))
    reader = CheckpointReader(str(tmp_path / "a"))
    ref = max(reader.pieces(), key=lambda r: r.nbytes)
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + ref.nbytes // 2)
    with pytest.raises(ChecksumMismatchError, match=re.escape(repr(ref.tensor))):
        _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, SMALL)
    assert not driver.live


def test_mapped_bytes_zero_stages_every_part(tmp_path, driver):
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=2, dp=2))
    off = LoadOptions(stage_bytes=SMALL.stage_bytes, mapped_bytes=0)
    _, out, state, _ = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, off)
    _check_landed(values, out, state)
    assert driver.calls == 0


def test_load_options_take_zero_for_mapped_bytes_only():
    assert LoadOptions(mapped_bytes=0).mapped_bytes == 0
    with pytest.raises(ValueError, match=r"mapped_bytes must be a positive integer, or 0 \(off\)"):
        LoadOptions(mapped_bytes=-1)
    with pytest.raises(ValueError, match="stage_bytes must be a positive integer, got 0"):
        LoadOptions(stage_bytes=0)


def test_without_a_cuda_driver_loads_stage(monkeypatch):
    """The fallbacks: host memory, ROCm (HIP's registration is not the CUDA driver's) and a machine whose CUDA
    driver library does not load all give no registrar."""
    assert page_lock.registrar_for(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    page_lock._driver.cache_clear()
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert page_lock.registrar_for(torch.device("cuda")) is None
    page_lock._driver.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(page_lock.ctypes, "CDLL", no_library)
    assert page_lock.registrar_for(torch.device("cuda")) is None
    page_lock._driver.cache_clear()


def test_the_driver_registrar_asks_for_a_read_only_portable_lock_and_reports_refusals():
    calls = []

    class Function:
        def __init__(self, name, code):
            self.name, self.code = name, code

        def __call__(self, *args):
            calls.append((self.name, args))
            return self.code

    lib = types.SimpleNamespace(cuMemHostRegister_v2=Function("register", 0), cuMemHostUnregister=Function("un", 0))
    registrar = page_lock.DriverRegistrar(lib)
    assert registrar.register(4096, 8192)
    registrar.unregister(4096)
    assert calls == [("register", (4096, 8192, 0x01 | 0x08)), ("un", (4096,))]
    lib.cuMemHostRegister_v2.code = 1  # CUDA_ERROR_INVALID_VALUE
    assert not registrar.register(4096, 8192)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_locked_copies_equal_staged_ones(tmp_path):
    from moeckpt.reshard.load import load_rank_state

    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=2, dp=2))
    for options in (SMALL, LoadOptions(stage_bytes=4096, mapped_bytes=0)):
        state = load_rank_state(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, device="cuda", options=options)
        for name, boxes in state.items():
            for box, got in boxes:
                assert torch.equal(got.cpu(), values[name][box.slices()]), (name, box)


def test_rows_scattered_into_place_keep_the_staging_grid_and_rows_that_land_as_they_are_take_the_mapped_one(
    tmp_path, driver, monkeypatch
):
    """A fill thread's device scratch holds one scattered part per turn: those parts stay on the staging grid
    (``stage_bytes``) however large ``mapped_bytes`` is; rows that land as they are need no scratch and go in
    parts of about ``mapped_bytes``."""
    from moeckpt.reshard.rules import ShardingRule, TpSplit
    from moeckpt.reshard.save import save_full_tensors
    from moeckpt.reshard.tensors import ParamSpec, logical_tensors

    seen: list[tuple[int, bool]] = []
    real = staging.Stager.copy_mapped

    def spy(self, host, release, dest):
        seen.append((host.numel(), isinstance(dest, staging.Scatter)))
        return real(self, host, release, dest)

    monkeypatch.setattr(staging.Stager, "copy_mapped", spy)
    rows, cols = 3000, 1024  # fp32: 4 KiB rows, 1,024 to a 4 MiB checksum block
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    options = LoadOptions(stage_bytes=1 << 20, mapped_bytes=16 << 20)
    block = CHECKSUM_BLOCK_BYTES  # parts are cut at checksum blocks: the staging grid is at least one
    for name, dim, stored, expect_scatter in (("halves", 1, 2, True), ("whole", 0, 1, False)):
        params = [ParamSpec(name="w", shape=(rows, cols), rule=ShardingRule(tp=TpSplit(dim=dim)))]
        save_full_tensors(
            str(tmp_path / name),
            tensors=logical_tensors(params, param_dtype="float32", with_optimizer=False),
            layout=Layout(tp=stored, ep=1, dp=1),
            values=lambda e: full,
            model={"arch": "toy", "config": {}},
        )
        seen.clear()
        _, out, state, _ = _load_into_out(str(tmp_path / name), Layout(tp=1, ep=1, dp=1), 0, options)
        ((box, got),) = state["w"]
        assert torch.equal(got, full), name
        assert seen and all(scattered == expect_scatter for _, scattered in seen), name
        largest = max(n for n, _ in seen)
        if expect_scatter:  # a half's rows, one block a part
            assert largest <= max(options.stage_bytes, block), largest
        else:  # the whole 11.7 MiB matrix in one part: more than a block, within the mapped grid
            assert block < largest <= options.mapped_bytes, largest
    assert not driver.live
