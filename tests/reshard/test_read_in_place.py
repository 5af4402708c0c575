"""Boxes made of several stored pieces read straight into place (:mod:`moeckpt.reshard.inplace`): the same bytes as
the full tensor, every checksum block around them verified, no block fetched twice.

The stored pieces are written by hand into one file with small checksum blocks, so that boxes of a few hundred
bytes already span many blocks, shared between rows, and both read modes (vectored reads into place for long
ranges, a buffer and strided copies for short ones) run on every layout Hypothesis draws.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moeckpt.formats.backends.safetensors import SafetensorsReader
from moeckpt.formats.box import Box
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.pieces import PieceRef, block_checksums
from moeckpt.formats.storages.local import LocalStorage
from moeckpt.reshard import inplace
from moeckpt.reshard.chunks import ChunkReader
from moeckpt.reshard.plan import ReadItem, TargetPiece
from moeckpt.reshard.slabs import row_spans

from ..helpers import flip_byte

FILE = "pieces.bin"


def _cuts(draw, n: int) -> list[tuple[int, int]]:
    """``n`` split into 1-3 consecutive ranges."""
    points = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    edges = [0, *points, n]
    return list(zip(edges, edges[1:]))


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    # Often the middle dims whole in every box (a split along the last dim: one range per sub-row).
    middle = range(1, ndim - 1) if draw(st.booleans()) else range(0)
    grid = [[(0, n)] if d in middle else _cuts(draw, n) for d, n in enumerate(shape)]
    sources = [Box(tuple(a for a, _ in c), tuple(b - a for a, b in c)) for c in itertools.product(*grid)]
    lo = [0 if d in middle else draw(st.integers(0, n - 1)) for d, n in enumerate(shape)]
    hi = [n if d in middle else draw(st.integers(a + 1, n)) for d, (a, n) in enumerate(zip(lo, shape))]
    target = Box(tuple(lo), tuple(b - a for a, b in zip(lo, hi)))
    block = draw(st.sampled_from([4, 12, 40, 64, 4096]))
    return shape, sources, target, block


def _store(tmp_path, shape, sources, block):
    """The full tensor (float32 ``arange``) and a ref per stored piece, written one after another into one file."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    refs, blobs, at = {}, [], 0
    for box in sources:
        data = full[box.slices()].contiguous().view(torch.uint8).numpy().tobytes()
        sums = tuple(block_checksums(data, block_bytes=block))
        refs[("t", box)] = PieceRef("t", box, "float32", FILE, at, len(data), sums, block_bytes=block)
        blobs.append(data)
        at += len(data)
    (tmp_path / FILE).write_bytes(b"".join(blobs))
    return full, refs


def _plan(sources, target) -> TargetPiece:
    reads = []
    for src in sources:
        region = src.intersect(target)
        if region is not None:
            reads.append(ReadItem("t", src, 0, region, target))
    return TargetPiece("t", target, tuple(reads))


def _covered_blocks(ref: PieceRef, item: ReadItem, span) -> int:
    """Bytes of the checksum blocks between the first byte ``item`` needs and its last one (what it may fetch)."""
    row = ref.nbytes // ref.box.shape[0]
    r0, r1 = item.rows
    a, b = r0 * row + span.c0, (r1 - 1) * row + (span.sub - 1) * (row // span.sub) + span.c1
    return min(-(-b // ref.block_bytes) * ref.block_bytes, ref.nbytes) - a // ref.block_bytes * ref.block_bytes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases(), vectored=st.booleans(), part=st.sampled_from([8, 64, 1 << 20]), threads=st.sampled_from([1, 3]))
def test_boxes_spanning_stored_pieces_are_read_in_place_exactly(tmp_path, monkeypatch, case, vectored, part, threads):
    shape, sources, target, block = case
    monkeypatch.setattr(inplace, "VECTORED_RANGE_BYTES", 0 if vectored else 1 << 30)
    monkeypatch.setattr(inplace, "COPY_PART_BYTES", part)
    full, refs = _store(tmp_path, shape, sources, block)
    piece = _plan(sources, target)
    dest = torch.full(target.shape, -1.0)
    spans = inplace.spans_in_place(piece, refs, dest)
    if spans is None:  # not one range per (sub-)row, or short ranges far apart: the chunk cache assembles it
        found = row_spans(piece, 4)
        assert found is None or not vectored
        event("assembled by the chunk cache")
        return
    event(f"in place, {'vectored' if vectored else 'through a buffer'}, sub-rows {max(s.sub for _, s in spans) > 1}")
    session = SafetensorsReader(LocalStorage(str(tmp_path)))
    with ChunkReader(session, refs) as chunks:
        jobs = [(0, item, dest, span) for item, span in spans]
        failed, fetched = inplace.read_in_place(chunks, jobs, threads, chunk_bytes=part)
    session.close()
    assert failed == set()
    assert torch.equal(dest, full[target.slices()])
    needed = target.numel * 4
    assert needed <= fetched <= sum(_covered_blocks(refs[("t", item.src_box)], item, s) for item, s in spans)


def test_the_tp_halves_of_a_matrix_and_of_an_expert_stack_are_spans():
    """What the library benchmark's load is made of: TP halves of an expert stack split along dim 1 (whole source
    rows, half a target row each) and along dim 2 (a sub-row is one expert row)."""
    gate_up = TargetPiece(
        "g",
        Box((0, 0, 0), (8, 800, 400)),
        (
            ReadItem(
                "g", Box((0, 0, 0), (8, 400, 400)), 0, Box((0, 0, 0), (8, 400, 400)), Box((0, 0, 0), (8, 800, 400))
            ),
            ReadItem(
                "g", Box((0, 400, 0), (8, 400, 400)), 1, Box((0, 400, 0), (8, 400, 400)), Box((0, 0, 0), (8, 800, 400))
            ),
        ),
    )
    spans = row_spans(gate_up, 2)
    assert spans is not None and [s for _, s in spans] == [(0, 320000, 0, 1), (0, 320000, 320000, 1)]
    down = TargetPiece(
        "d",
        Box((0, 0, 0), (4, 400, 400)),
        (
            ReadItem(
                "d", Box((0, 0, 0), (8, 400, 200)), 0, Box((0, 0, 0), (4, 400, 200)), Box((0, 0, 0), (4, 400, 400))
            ),
            ReadItem(
                "d", Box((0, 0, 200), (8, 400, 200)), 1, Box((0, 0, 200), (4, 400, 200)), Box((0, 0, 0), (4, 400, 400))
            ),
        ),
    )
    spans = row_spans(down, 4)
    assert spans is not None and [s for _, s in spans] == [(0, 800, 0, 400), (0, 800, 800, 400)]


@pytest.mark.parametrize("vectored", [True, False], ids=["vectored", "through a buffer"])
def test_a_flipped_byte_between_the_ranges_is_caught(tmp_path, monkeypatch, vectored):
    """The bytes of a checksum block that the box does not need (another rank's half of a row) are read into
    scratch and hashed: a flipped byte there fails the load, naming the tensor."""
    monkeypatch.setattr(inplace, "VECTORED_RANGE_BYTES", 0 if vectored else 1 << 30)
    shape, block = (6, 8), 40
    sources = [Box((0, 0), (6, 8))]
    target = Box((1, 2), (4, 3))  # 12 of each 32-byte row: the rest of each row is read into scratch
    full, refs = _store(tmp_path, shape, sources, block)
    flip_byte(str(tmp_path), FILE, 2 * 32 + 28)  # row 2, column 7: not in the box, in a block it needs
    piece = _plan(sources, target)
    dest = torch.zeros(target.shape)
    spans = inplace.spans_in_place(piece, refs, dest)
    assert spans is not None
    session = SafetensorsReader(LocalStorage(str(tmp_path)))
    with ChunkReader(session, refs) as chunks, pytest.raises(ChecksumMismatchError, match="'t'"):
        inplace.read_in_place(chunks, [(0, item, dest, s) for item, s in spans], 2, chunk_bytes=64)
    session.close()


def test_the_scratch_of_a_thread_is_reused_and_every_read_still_verified(tmp_path):
    """The bytes read only to be hashed land in one reused buffer per thread (a fresh one per read cost a page
    fault per page): a second read through the same session fills it anew, so a byte flipped in between is
    caught though the buffer still holds the first read's good bytes."""
    shape, block = (6, 8), 40
    sources = [Box((0, 0), (6, 8))]
    target = Box((1, 2), (4, 3))
    full, refs = _store(tmp_path, shape, sources, block)
    piece = _plan(sources, target)
    (item,) = piece.reads
    ref = refs[("t", sources[0])]
    session = SafetensorsReader(LocalStorage(str(tmp_path)))
    segments = lambda out: [(r * 32 + 8, out[r - 1].numpy().data.cast("B")) for r in range(1, 5)]  # noqa: E731
    first = torch.zeros(target.shape)
    assert session.read_segments_into(ref, segments(first))
    assert torch.equal(first, full[target.slices()])
    scratch = session._scratch.buf
    flip_byte(str(tmp_path), FILE, 2 * 32 + 28)  # row 2, column 7: scratch, in a block the read needs
    with pytest.raises(ChecksumMismatchError, match="'t'"):
        session.read_segments_into(ref, segments(torch.zeros(target.shape)))
    assert session._scratch.buf is scratch  # the same buffer, filled again
    session.close()
