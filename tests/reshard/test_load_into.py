"""Loads that read rows straight into the destination tensor: same bytes, every checksum block still verified."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from moeckpt.formats.backends import safetensors as safetensors_backend
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.pieces import CHECKSUM_BLOCK_BYTES
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import ParamSpec, logical_tensors

from ..helpers import flip_byte

#: 3,000 rows of 4,096 bytes (fp32 x 1,024): 11.7 MB, three checksum blocks and a part, rows dividing blocks.
ROWS, COLS = 3000, 1024


def _save(location: str, layout: Layout, rule: ShardingRule | None = None) -> torch.Tensor:
    rule = ShardingRule(tp=TpSplit(dim=0)) if rule is None else rule
    params = [ParamSpec(name="w", shape=(ROWS, COLS), rule=rule)]
    tensors = logical_tensors(params, param_dtype="float32", with_optimizer=False)
    full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    save_full_tensors(
        location, tensors=tensors, layout=layout, values=lambda e: full, model={"arch": "toy", "config": {}}
    )
    return full


@pytest.mark.parametrize("step", [None, 3001], ids=["default step", "odd step"])
def test_rows_read_into_a_tensor_equal_the_rows_read_and_verify_the_blocks_around_them(tmp_path, monkeypatch, step):
    """Also with reads hashed a step at a time where the steps divide neither rows nor blocks."""
    if step is not None:
        monkeypatch.setattr(safetensors_backend, "HASH_STEP_BYTES", step)
    # replicated: blocks of CHECKSUM_BLOCK_BYTES along the flat bytes (a TP split along dim 0 would give the piece
    # blocks that end at the split's rows, format version 5)
    _save(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), ShardingRule())
    reader = CheckpointReader(str(tmp_path / "a"))
    (ref,) = reader.pieces()
    session = reader.open_reader()
    try:
        for lo, hi in [(0, ROWS), (1, 2), (1000, 2049), (1023, 1025), (2900, ROWS)]:  # starts and ends mid-block
            out = torch.empty(hi - lo, COLS)
            assert session.read_rows_into(ref, lo, hi, out)
            assert torch.equal(out, session.read_rows(ref, lo, hi))
        assert not session.read_rows_into(ref, 0, 10, torch.empty(9, COLS))  # not those rows' bytes: refused
    finally:
        session.close()
    # A flipped byte in a block the rows touch but outside the rows (read into scratch) is still caught.
    row_bytes = COLS * 4
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + 1020 * row_bytes)
    session = reader.open_reader()
    try:
        with pytest.raises(ChecksumMismatchError, match="block 0"):
            session.read_rows_into(ref, 1023, 1025, torch.empty(2, COLS))
        assert session.read_rows_into(ref, 1024, 1025, torch.empty(1, COLS))  # block 1 is intact
    finally:
        session.close()
    assert CHECKSUM_BLOCK_BYTES == 1024 * row_bytes  # the rows above straddle blocks 0 and 1


@pytest.mark.parametrize("threads", [1, 3])
def test_a_load_alone_reads_boxes_in_place_with_every_byte_checked(tmp_path, threads):
    full = _save(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1))
    options = LoadOptions(fill_threads=threads, chunk_bytes=CHECKSUM_BLOCK_BYTES)  # several parts per box
    for rank in (0, 1):
        stats = LoadStats()
        state = load_rank_state(str(tmp_path / "a"), Layout(tp=2, ep=1, dp=1), rank, stats=stats, options=options)
        ((box, t),) = state["w"]
        assert torch.equal(t, full[box.slices()])
        assert stats.bytes_needed <= stats.bytes_read <= stats.bytes_needed + 2 * CHECKSUM_BLOCK_BYTES
    reader = CheckpointReader(str(tmp_path / "a"))
    (ref,) = reader.pieces()
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + ref.nbytes - 5)
    with pytest.raises(ChecksumMismatchError):
        load_rank_state(str(tmp_path / "a"), Layout(tp=2, ep=1, dp=1), 1, options=options)


def test_device_and_out_give_the_same_tensors_and_fill_the_callers_tensors(tmp_path):
    """The device path on a CPU-only machine (device="cpu", preallocated destinations) loads the same bytes, into
    the caller's tensors where they fit; a destination of another dtype is left alone and a new tensor returned."""
    from moeckpt.trainer.models import presets

    from ..reshard_models import save_model

    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=1, dp=2))
    target = Layout(tp=2, ep=2, dp=2)
    plain = load_rank_state(str(tmp_path / "a"), target, 1)
    out = {(n, box): torch.full_like(t, 7) for n, boxes in plain.items() for box, t in boxes}
    odd = next(iter(out))
    out[odd] = out[odd].double()  # not the stored dtype: not used
    state = load_rank_state(str(tmp_path / "a"), target, 1, device="cpu", out=out)
    for name, boxes in plain.items():
        for (box, want), (box2, got) in zip(boxes, state[name]):
            assert box == box2 and torch.equal(want, got), name
            if (name, box) != odd:
                assert got is out[(name, box)]
    assert state[odd[0]][[b for b, _ in state[odd[0]]].index(odd[1])][1] is not out[odd]


def test_the_staging_path_copies_through_reused_buffers(tmp_path):
    """Stager (the host-to-device path) on the CPU: rows read into one of two reused buffers, then copied."""
    from moeckpt.reshard.inplace import Stager

    full = _save(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1))
    reader = CheckpointReader(str(tmp_path / "a"))
    (ref,) = reader.pieces()
    session = reader.open_reader()
    try:
        stager = Stager(1500 * COLS * 4, torch.device("cpu"))
        dest = torch.empty(ROWS, COLS)
        for lo in range(0, ROWS, 1500):
            assert stager.read(functools.partial(session.read_rows_into, ref, lo, lo + 1500), dest[lo : lo + 1500])
        stager.finish()
        assert torch.equal(dest, full) and stager.turn == 0
    finally:
        session.close()


@pytest.mark.parametrize(("rows", "blocks"), [(2048, None), (4096, (2048, 2048))], ids=["plain", "fused gate/up"])
def test_a_tp_rank_alone_reads_only_its_slice_of_each_expert(tmp_path, rows, blocks):
    """An expert matrix split along dim 1 is one byte range per expert (two for fused gate and up halves): a TP
    rank reading alone fetches its slices (whole checksum blocks here), not every expert whole (before: 2x)."""
    experts, cols = 2, 1024  # fp32: 8 or 16 MiB per expert, 2 or 4 blocks; each slice 4 MiB
    rule = ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=blocks) if blocks else TpSplit(dim=1))
    params = [ParamSpec(name="e", shape=(experts, rows, cols), rule=rule)]
    tensors = logical_tensors(params, param_dtype="float32", with_optimizer=False)
    full = torch.randn(experts, rows, cols, generator=torch.Generator().manual_seed(0))
    save_full_tensors(
        str(tmp_path / "a"),
        tensors=tensors,
        layout=Layout(tp=1, ep=1, dp=1),
        values=lambda e: full,
        model={"arch": "toy", "config": {}},
    )
    for threads in (1, 3):
        for rank in (0, 1):
            stats = LoadStats()
            state = load_rank_state(
                str(tmp_path / "a"),
                Layout(tp=2, ep=1, dp=1),
                rank,
                stats=stats,
                options=LoadOptions(fill_threads=threads),
            )
            for box, t in state["e"]:
                assert torch.equal(t, full[box.slices()])
            assert stats.bytes_read == stats.bytes_needed == experts * rows * cols * 2
    reader = CheckpointReader(str(tmp_path / "a"))
    (ref,) = reader.pieces()
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + 8 * 1024 * 1024 + 5)  # expert 1, rank 0's slice
    with pytest.raises(ChecksumMismatchError):
        load_rank_state(str(tmp_path / "a"), Layout(tp=2, ep=1, dp=1), 0)
    load_rank_state(str(tmp_path / "a"), Layout(tp=2, ep=1, dp=1), 1)  # rank 1's slices are intact


def test_small_pieces_are_read_in_runs_straight_into_their_tensors(tmp_path, monkeypatch):
    """On the CPU too, small pieces back to back in a file are read in runs: one vectored read straight into
    each piece's own tensor (no buffer), every piece verified; a flipped byte in one of them names it."""
    from moeckpt.reshard import inplace
    from moeckpt.trainer.models import presets

    from ..reshard_models import save_model

    found = []
    real = inplace.coalesce

    def spy(whole, stage_bytes, run_into):
        parts, alone = real(whole, stage_bytes, run_into)
        found.append((len(whole), parts))
        return parts, alone

    monkeypatch.setattr(inplace, "coalesce", spy)
    location = str(tmp_path / "a")
    _, values = save_model(location, presets()["zaya-tiny"], Layout(tp=1, ep=1, dp=1))
    reader = CheckpointReader(location)
    out = {(r.tensor, r.box): torch.zeros(r.box.shape, dtype=values[r.tensor].dtype) for r in reader.pieces()}
    state = load_rank_state(location, Layout(tp=1, ep=1, dp=1), 0, out=out)
    for name, boxes in state.items():
        for box, got in boxes:
            assert got is out[(name, box)] and torch.equal(got, values[name]), name
    ((pieces, runs),) = found
    assert pieces > 100 and 1 <= len(runs) <= 4 and not any(run.staged for *_, run in runs)
    ref = sorted(reader.pieces(), key=lambda r: r.start)[40]
    flip_byte(location, ref.file, ref.start + ref.nbytes // 2)
    with pytest.raises(ChecksumMismatchError, match=re.escape(repr(ref.tensor))):
        load_rank_state(location, Layout(tp=1, ep=1, dp=1), 0, out=out)
