"""Loads that hash whole checksum blocks where they land (the device) instead of on the host before the copy.

On a GPU with Triton a kernel computes each block's xxh3 accumulators (:mod:`moeckpt.reshard.device_checks`).
Here, on the CPU, the staged path runs on the host (``STAGE_HOST_MEMORY``) and the host reference of the same
accumulators stands in for the kernel: every layout class lands the saved bytes, every block of the rows read
unhashed is checked, and a corrupt block fails the load naming its file, tensor and block. The kernel itself is
compared with xxhash by Triton's interpreter on the CPU (where Triton is installed, as the tests' clients install
it) and on a GPU (skipped where there is none).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from moeckpt.formats.backends import safetensors
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.checksum import checksum
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.xxh3_parts import accumulators, checksum_of
from moeckpt.reshard import device_checks, staging
from moeckpt.reshard.device_checks import DeviceChecks
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import ParamSpec, logical_tensors
from moeckpt.trainer.models import presets

from ..helpers import flip_byte
from ..reshard_models import save_model
from .test_staged_load import CASES, _load_into_out

#: fp32 rows of 4 KiB: 12 MB, several checksum blocks and a shorter last one
ROWS, COLS = 3000, 1024
OPTIONS = LoadOptions(stage_bytes=1 << 20, checksums_on_device=True)
SMALL = LoadOptions(stage_bytes=4096, checksums_on_device=True)


class Reference:
    """The host reference of the device's accumulators, counting the bytes it hashed."""

    def __init__(self) -> None:
        self.hashed = 0

    def __call__(self, data: torch.Tensor, first: int, nbytes: int, count: int) -> torch.Tensor:
        host = data.cpu().numpy()
        accs = [accumulators(host[first + i * nbytes : first + (i + 1) * nbytes].data) for i in range(count)]
        self.hashed += nbytes * count
        return torch.from_numpy(np.array(accs, dtype=np.uint64).view(np.int64))


@pytest.fixture
def reference(monkeypatch):
    monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    ref = Reference()
    monkeypatch.setattr(device_checks, "accumulator_for", lambda device: ref)
    return ref


@pytest.fixture
def host_hashes(monkeypatch):
    """Bytes hashed on the host by the staged path's verified reads."""
    seen = {"bytes": 0}
    real = safetensors.SafetensorsReader._read_verified

    def spy(self, ref, offset, parts, first_block):
        seen["bytes"] += sum(len(p) for p in parts)
        return real(self, ref, offset, parts, first_block)

    monkeypatch.setattr(safetensors.SafetensorsReader, "_read_verified", spy)
    return seen


def _save_matrix(location: str, tp: int, dim: int) -> torch.Tensor:
    full = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    params = [ParamSpec(name="w", shape=(ROWS, COLS), rule=ShardingRule(tp=TpSplit(dim=dim)))]
    save_full_tensors(
        location,
        tensors=logical_tensors(params, param_dtype="float32", with_optimizer=False),
        layout=Layout(tp=tp, ep=1, dp=1),
        values=lambda e: full,
        model={"arch": "toy", "config": {}},
    )
    return full


@pytest.mark.parametrize("stored,dim", [(1, 0), (2, 0)], ids=["rows land as they are", "TP halves joined along rows"])
def test_every_block_is_hashed_where_it_lands_and_none_on_the_host(tmp_path, reference, host_hashes, stored, dim):
    full = _save_matrix(str(tmp_path / "a"), stored, dim)
    _, out, state, stats = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, OPTIONS)
    ((_, got),) = state["w"]
    assert torch.equal(got, full)
    stored_bytes = sum(r.nbytes for r in CheckpointReader(str(tmp_path / "a")).pieces())
    assert reference.hashed == stored_bytes, "every stored byte hashed once, where it landed"
    assert host_hashes["bytes"] == 0
    assert stats.bytes_read == stored_bytes


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_layout_class_lands_exactly(tmp_path, reference, case):
    (st, se, sd), (tt, te, td), rank = CASES[case]
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=st, ep=se, dp=sd))
    # parts small enough that zaya-tiny's matrices are parts of their own, not coalesced into runs
    _, out, state, _ = _load_into_out(str(tmp_path / "a"), Layout(tp=tt, ep=te, dp=td), rank, SMALL)
    for name, boxes in state.items():
        for box, got in boxes:
            assert got is out[(name, box)], name
            assert torch.equal(got, values[name][box.slices()]), (name, box)
    assert reference.hashed > 0


@pytest.mark.parametrize("block", [0, 2])
def test_a_corrupt_block_fails_the_load_naming_file_tensor_and_block(tmp_path, reference, block):
    _save_matrix(str(tmp_path / "a"), 1, 0)
    reader = CheckpointReader(str(tmp_path / "a"))
    (ref,) = reader.pieces()
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + block * ref.block_bytes + 77)
    pattern = rf"{re.escape(ref.file)}: checksum mismatch in tensor 'w' .* block {block} "
    with pytest.raises(ChecksumMismatchError, match=pattern):
        _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, OPTIONS)


def test_checksums_on_device_are_off_by_default_and_every_byte_is_hashed_on_the_host(tmp_path, reference, host_hashes):
    full = _save_matrix(str(tmp_path / "a"), 1, 0)
    off = LoadOptions(stage_bytes=OPTIONS.stage_bytes)
    _, _, state, _ = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, off)
    assert torch.equal(state["w"][0][1], full)
    assert reference.hashed == 0 and host_hashes["bytes"] > 0


def test_load_options_take_a_bool_for_checksums_on_device():
    with pytest.raises(ValueError, match="checksums_on_device must be True or False"):
        LoadOptions(checksums_on_device=1)  # type: ignore[arg-type]


def test_only_rows_of_whole_long_blocks_go_to_the_device(tmp_path):
    _save_matrix(str(tmp_path / "a"), 1, 0)
    (ref,) = CheckpointReader(str(tmp_path / "a")).pieces()
    per = ref.block_bytes // (COLS * 4)  # rows to a block
    assert DeviceChecks.takes(ref, 0, ROWS)
    assert DeviceChecks.takes(ref, per, 2 * per)
    assert not DeviceChecks.takes(ref, 1, per), "starts inside a block"
    assert not DeviceChecks.takes(ref, 0, per + 1), "ends inside a block"

    # a piece whose last block is one of xxh3's short inputs: its rows hash on the host
    def ending(extra: int):  # a 1-d piece of one whole block and ``extra`` bytes
        n = ref.block_bytes + extra
        return dataclasses.replace(ref, nbytes=n, box=Box((0,), (n // 4,)), slice_dim=0, slices=())

    assert DeviceChecks.takes(ending(400), 0, (ref.block_bytes + 400) // 4)
    short = ending(200)
    assert not DeviceChecks.takes(short, 0, short.box.shape[0])


#: run by a fresh interpreter: Triton reads TRITON_INTERPRET when it is imported (its reductions are kernels too)
_INTERPRETED = """
import numpy as np, torch
from moeckpt.formats.checksum import checksum
from moeckpt.formats.xxh3_parts import checksum_of
from moeckpt.reshard.device_checks import triton_accumulate

raw = np.random.default_rng(7).integers(0, 256, 24_000, dtype=np.uint8)
data = torch.from_numpy(raw)
# whole words and unaligned starts, one 1,024-byte step and several, lengths that end mid-stripe
for first, nbytes, count in [(0, 4096, 2), (8, 1025, 3), (3, 2049, 2), (0, 241, 4), (16, 5000, 2)]:
    accs = triton_accumulate(data, first, nbytes, count).numpy().view(np.uint64)
    for i in range(count):
        part = raw[first + i * nbytes : first + (i + 1) * nbytes].tobytes()
        assert checksum_of(accs[i].tolist(), nbytes) == checksum(part), (first, nbytes, i)
print("equal")
"""


def test_the_kernel_run_by_the_interpreter_gives_xxh3_64():
    """The Triton kernel itself, run by Triton's interpreter on the CPU (numpy in place of a GPU)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-3000:]


needs_triton_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or device_checks._kernel() is None, reason="needs a GPU with Triton"
)


@needs_triton_gpu
def test_the_kernel_gives_xxh3_64_at_any_offset_and_length():
    raw = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    data = torch.from_numpy(raw).cuda()
    for first, nbytes, count in [(0, 1 << 20, 3), (8, 1025, 7), (3, 4099, 5), (0, 241, 9), (16, 70001, 2)]:
        accs = device_checks.triton_accumulate(data, first, nbytes, count).cpu().numpy().view(np.uint64)
        for i in range(count):
            part = raw[first + i * nbytes : first + (i + 1) * nbytes].tobytes()
            assert checksum_of(accs[i].tolist(), nbytes) == checksum(part), (first, nbytes, i)


@needs_triton_gpu
def test_a_gpu_load_hashes_on_the_device_and_catches_a_corrupt_block(tmp_path, host_hashes):
    full = _save_matrix(str(tmp_path / "a"), 2, 0)
    from moeckpt.reshard.load import load_rank_state

    out = {("w", Box((0, 0), (ROWS, COLS))): torch.empty(ROWS, COLS, device="cuda")}
    state = load_rank_state(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, device="cuda", out=out, options=OPTIONS)
    assert torch.equal(state["w"][0][1].cpu(), full)
    assert host_hashes["bytes"] == 0
    (ref, *_) = CheckpointReader(str(tmp_path / "a")).pieces()
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + 5)
    with pytest.raises(ChecksumMismatchError, match="block 0"):
        load_rank_state(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, device="cuda", out=out, options=OPTIONS)
