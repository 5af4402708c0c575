"""Loads into device memory (pinned staging), run on the CPU: every layout class lands in place, none assembled.

:func:`~moeckpt.reshard.staging.stages` decides which destinations go through staging; here it is made to say
yes for host tensors, so the paths a GPU load takes (staged whole rows, byte ranges, rows scattered into place)
run with plain copies and are checked byte for byte against the saved tensors.
"""

from __future__ import annotations

import re

import pytest
import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.pieces import PieceRef
from moeckpt.reshard import fill as fill_module
from moeckpt.reshard import staging
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.plan import ReadItem, TargetPiece
from moeckpt.reshard.planner import plan_load
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import ParamSpec, logical_tensors
from moeckpt.trainer.models import presets

from ..helpers import flip_byte
from ..reshard_models import save_model


@pytest.fixture
def staged(monkeypatch):
    """Host tensors are loaded as device tensors are, and any box assembled on the host is counted."""
    monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    assembled: list[str] = []
    real_assemble, real_fill = fill_module.assemble, fill_module.fill

    def assemble(piece, dtype, chunks):
        assembled.append(piece.tensor)
        return real_assemble(piece, dtype, chunks)

    def fill(dest, box, reads, chunks):
        assembled.append(reads[0].tensor if reads else "?")
        return real_fill(dest, box, reads, chunks)

    monkeypatch.setattr(fill_module, "assemble", assemble)
    monkeypatch.setattr(fill_module, "fill", fill)
    return assembled


def _load_into_out(location: str, layout: Layout, rank: int, options: LoadOptions | None = None):
    reader = CheckpointReader(location)
    (rank_plan,) = plan_load(reader.index, layout, [rank]).ranks
    out = {
        (p.tensor, p.box): torch.full(p.box.shape, -7, dtype=dtypes.to_torch(reader.index.tensors[p.tensor].dtype))
        for p in rank_plan.pieces
    }
    stats = LoadStats()
    state = load_rank_state(location, layout, rank, out=out, stats=stats, options=options)
    return reader, out, state, stats


CASES = {
    "join ZeRO parts and expert halves": ((1, 2, 2), (1, 1, 1), 0),
    "join TP halves along columns": ((2, 1, 1), (1, 1, 1), 0),
    "split into TP halves": ((1, 1, 1), (2, 1, 1), 1),
    "uneven dp with a TP and EP change": ((2, 2, 2), (1, 1, 3), 2),
    "the same layout": ((2, 2, 2), (2, 2, 2), 3),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_staged_load_lands_every_box_in_place_without_host_assembly(tmp_path, staged, case):
    (st, se, sd), (tt, te, td), rank = CASES[case]
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=st, ep=se, dp=sd))
    _, out, state, stats = _load_into_out(str(tmp_path / "a"), Layout(tp=tt, ep=te, dp=td), rank)
    for name, boxes in state.items():
        for box, got in boxes:
            assert got is out[(name, box)], name
            assert torch.equal(got, values[name][box.slices()]), (name, box)
    assert not [n for n in staged if values[n].dim()], "boxes assembled on the host"
    assert stats.bytes_read <= 1.05 * stats.bytes_needed + len(state) * 4 * 1024 * 1024


def test_rows_wider_than_a_stage_part_and_a_region_of_them_are_scattered_on_the_part_grid(tmp_path, staged):
    """A matrix saved in TP halves along its columns, loaded whole in small stage parts: each part of each half
    is read whole and lands in its columns; every checksum block is fetched once."""
    rows, cols = 3000, 1024  # fp32: 4 KiB rows, 1,024 to a checksum block
    params = [ParamSpec(name="w", shape=(rows, cols), rule=ShardingRule(tp=TpSplit(dim=1)))]
    tensors = logical_tensors(params, param_dtype="float32", with_optimizer=False)
    full = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    save_full_tensors(
        str(tmp_path / "a"),
        tensors=tensors,
        layout=Layout(tp=2, ep=1, dp=1),
        values=lambda e: full,
        model={"arch": "toy", "config": {}},
    )
    options = LoadOptions(stage_bytes=1024 * 1024)  # parts of 512 rows of each half
    _, out, state, stats = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0, options)
    ((box, got),) = state["w"]
    assert got is out[("w", box)] and torch.equal(got, full)
    assert not staged
    assert stats.bytes_read == full.numel() * 4  # the halves' blocks, each once


def test_reads_of_the_same_rows_share_a_group_and_rows_that_overlap_otherwise_are_left_to_the_chunk_cache():
    """Two boxes taking different columns of the same stored rows (a TP rank's fused gate and up halves) are one
    group: the rows are read once for both. Boxes whose row ranges of one stored piece overlap without being
    equal are not scattered (each would read the shared rows whole); the chunk cache reads those once."""
    src = Box((0, 0), (8, 4))
    ref = PieceRef("w", src, "float32", file="f", start=0, nbytes=8 * 4 * 4, checksums=("x",) * 2, block_bytes=64)
    refs = {("w", src): ref}

    def piece(rows: tuple[int, int], cols: tuple[int, int]) -> TargetPiece:
        box = Box((rows[0], cols[0]), (rows[1] - rows[0], cols[1] - cols[0]))
        return TargetPiece("w", box, (ReadItem("w", src, 0, box, box),))

    dests = [torch.empty(2, 2)] * 4
    same = [piece((0, 4), (0, 2)), piece((0, 4), (2, 4))]
    (group,) = staging.scatter_groups(same, [torch.empty(4, 2)] * 2, [0, 1], refs)
    assert group.rows == (0, 4) and group.positions == {0, 1}
    apart = [piece((0, 2), (0, 2)), piece((2, 4), (0, 2))]
    assert [g.positions for g in staging.scatter_groups(apart, dests, [0, 1], refs)] == [{0}, {1}]
    overlapping = [piece((0, 3), (0, 2)), piece((2, 5), (2, 4)), piece((6, 8), (0, 4))]
    assert [g.positions for g in staging.scatter_groups(overlapping, dests, [0, 1, 2], refs)] == [{2}]


def test_stages_says_no_for_host_memory_unless_asked():
    assert not staging.stages(torch.empty(2))
    if torch.cuda.is_available():
        assert staging.stages(torch.empty(2, device="cuda"))


def test_small_pieces_back_to_back_in_a_file_are_read_in_runs(tmp_path, staged, monkeypatch):
    """zaya-tiny is hundreds of small pieces: a staged load reads them in a few runs (one read, every piece
    verified), each landing in its own destination."""
    from moeckpt.reshard import inplace

    found = []
    real = inplace.coalesce

    def spy(whole, stage_bytes, run_into):
        parts, alone = real(whole, stage_bytes, run_into)
        found.append((len(whole), parts, alone))
        return parts, alone

    monkeypatch.setattr(inplace, "coalesce", spy)
    _, values = save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=1, dp=2))
    _, out, state, _ = _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0)
    for name, boxes in state.items():
        for box, got in boxes:
            assert got is out[(name, box)] and torch.equal(got, values[name][box.slices()]), (name, box)
    ((pieces, runs, alone),) = found
    assert pieces > 100 and 1 <= len(runs) <= 4 and not alone
    assert sum(len(run.lands) for *_, run in runs) == pieces


def test_a_flipped_byte_in_a_run_is_caught_and_names_the_piece(tmp_path, staged):
    save_model(str(tmp_path / "a"), presets()["zaya-tiny"], Layout(tp=1, ep=1, dp=1))
    reader = CheckpointReader(str(tmp_path / "a"))
    ref = sorted(reader.pieces(), key=lambda r: r.start)[40]
    flip_byte(str(tmp_path / "a"), ref.file, ref.start + ref.nbytes // 2)
    with pytest.raises(ChecksumMismatchError, match=re.escape(repr(ref.tensor))):
        _load_into_out(str(tmp_path / "a"), Layout(tp=1, ep=1, dp=1), 0)


def test_runs_are_pieces_of_one_file_back_to_back_within_a_stage_part():
    def ref(file: str, start: int, nbytes: int) -> PieceRef:
        return PieceRef("t", Box((0,), (nbytes,)), "uint8", file=file, start=start, nbytes=nbytes, checksums=("x",))

    refs = [
        ref("a", 0, 100),
        ref("a", 100, 100),  # back to back
        ref("a", 200 + staging.RUN_GAP_BYTES, 100),  # the largest gap a run reads over
        ref("a", 400 + 2 * staging.RUN_GAP_BYTES, 100),  # a gap too wide: a new run
        ref("a", 500 + 2 * staging.RUN_GAP_BYTES, 100),
        ref("b", 100, 100),  # another file: alone
        ref("a", 10**6, 5000),  # more than a quarter of a stage part: alone
    ]
    whole = [({i}, r, torch.empty(r.nbytes, dtype=torch.uint8)) for i, r in enumerate(refs)]
    parts, alone = staging.coalesce(whole, 16384, lambda refs, out: True)
    assert [sorted(where) for where, *_ in parts] == [[0, 1, 2], [3, 4]]
    assert [run.nbytes for *_, run in parts] == [300 + staging.RUN_GAP_BYTES, 200]
    assert [at for _, at in parts[0][3].lands] == [0, 100, 200 + staging.RUN_GAP_BYTES]
    assert alone == [5, 6]
    parts, alone = staging.coalesce(whole[:3], 450, lambda refs, out: True)  # 450-byte parts: one run of two
    assert [sorted(where) for where, *_ in parts] == [[0, 1]] and alone == [2]
