"""Format version 5: checksums that follow the TP split (docs/format.md, "Checksum slices").

A tp=2 rank loading a tp=1 checkpoint reads only its own bytes of every TP-split tensor and still verifies every
byte it reads; a flipped byte in one rank's columns fails that rank only; the checkpoints of version 1 with such
tensors (written before version 5) read as before; the spec's own reader verifies the new version.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch

from moeckpt.formats.backends import safetensors
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard import staging
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state, local_tensors
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from tests import spec_reader
from tests.formats import golden_slices

GOLDEN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "golden")
FILES = ["moeckpt.json", "rank-00000.safetensors"]


def _entry(name: str, shape: tuple[int, ...], dtype: str, rule: ShardingRule, role: str = "param") -> TensorEntry:
    return TensorEntry(name=name, shape=shape, dtype=dtype, role=role, param=name, sharding=rule.to_json())


#: rows narrower than a block and pieces of several row groups (a 16 MiB row-parallel weight), an expert tensor
#: whose fused halves are split along dim 1, one split along its last dim, and a dim-0 split.
TENSORS = {
    "o": _entry("o", (8192, 1024), "bfloat16", ShardingRule(tp=TpSplit(dim=1))),
    "gate_up": _entry(
        "gate_up", (2, 1024, 512), "float32", ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(512, 512)))
    ),
    "down": _entry("down", (2, 512, 512), "float32", ShardingRule(expert_dim=0, tp=TpSplit(dim=2))),
    "q": _entry("q", (1024, 1024), "float32", ShardingRule(tp=TpSplit(dim=0))),
    "norm": _entry("norm", (1024,), "float32", ShardingRule()),
}


def _value(entry: TensorEntry) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, entry.name)))
    return torch.randn(entry.shape, generator=g).to(torch.bfloat16 if entry.dtype == "bfloat16" else torch.float32)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("slices") / "tp1")
    save_full_tensors(path, tensors=TENSORS, layout=Layout(tp=1), values=_value, model={"arch": "toy", "config": {}})
    return path


def _header(path: str, file: str = "rank-00000.safetensors") -> dict:
    with open(os.path.join(path, file), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _expected(rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of tp=2 holds of each tensor (its local tensor)."""
    full = {n: _value(e) for n, e in TENSORS.items()}
    half = lambda t, dim: t.chunk(2, dim)[rank]  # noqa: E731
    gate, up = full["gate_up"].chunk(2, 1)
    return {
        "o": half(full["o"], 1),
        "gate_up": torch.cat([half(gate, 1), half(up, 1)], 1),
        "down": half(full["down"], 2),
        "q": half(full["q"], 0),
        "norm": full["norm"],
    }


def test_a_tp1_checkpoint_of_tp_split_tensors_is_version_5_with_slices_and_row_blocks(tp1):
    index = json.load(open(os.path.join(tp1, "moeckpt.json")))
    assert index["format_version"] == 5
    meta = _header(tp1)["__metadata__"]
    assert meta["moeckpt.format_version"] == "2"
    assert meta["o@0,0#slices"] == "1:" + ",".join(["128"] * 8)
    assert meta["gate_up@0,0,0#slices"] == "1:" + ",".join(["64"] * 16)  # each fused half in 8
    assert meta["down@0,0,0#slices"] == "2:" + ",".join(["64"] * 8)
    assert meta["q@0,0#block"] == str(128 * 1024 * 4)  # blocks of 128 rows: the tp=2 cut at row 512 ends one
    assert "norm@0#slices" not in meta and "norm@0#block" not in meta
    assert len(meta["o@0,0"].split(",")) == 8 * 4  # 8 slices x 4 groups of 2,048 rows (2 KiB each)


@pytest.mark.parametrize("mapped", [False, True], ids=["read-per-row", "mapped"])
@pytest.mark.parametrize("staged", [False, True])
def test_a_tp2_rank_of_a_tp1_checkpoint_reads_only_its_bytes(tp1, monkeypatch, staged, mapped):
    if staged:  # the device path (pinned staging, device copies), run on the host
        monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", True)
    if not mapped:  # every sliced read by a read call per row, as where the storage maps nothing
        monkeypatch.setattr(safetensors, "MAPPED_COLUMN_ROWS", 1 << 62)
    preads = []
    real = os.preadv

    def counting(fd, buffers, offset, *args):  # every byte the loader reads from the data files, independently
        n = real(fd, buffers, offset, *args)
        preads.append(n)
        return n

    copy_mapped = safetensors.SafetensorsReader._copy_columns_mapped
    mapped_copies: list[int] = []

    def counting_mapped(self, file, base, stride, rows):  # the bytes copied out of a mapping: each row's width
        copied = copy_mapped(self, file, base, stride, rows)
        if copied:
            preads.append(rows.size)
            mapped_copies.append(rows.size)
        return copied

    monkeypatch.setattr(os, "preadv", counting)
    monkeypatch.setattr(safetensors.SafetensorsReader, "_copy_columns_mapped", counting_mapped)
    for rank in (0, 1):
        preads.clear()
        stats = LoadStats()
        state = load_rank_state(tp1, Layout(tp=2), rank, stats=stats)
        reader = CheckpointReader(tp1)
        local = local_tensors(state, reader.index.tensors, Layout(tp=2), rank)
        for name, want in _expected(rank).items():
            assert torch.equal(local[name], want), name
        assert stats.bytes_read <= 1.05 * stats.bytes_needed, (stats.bytes_read, stats.bytes_needed)
        assert sum(preads) <= 1.05 * stats.bytes_needed, (sum(preads), stats.bytes_needed)
    assert bool(mapped_copies) == mapped  # the path the case names is the one taken


def test_zero_parts_that_cut_row_groups_read_their_columns_verified(tmp_path, monkeypatch):
    """An optimizer moment at tp=2 dp=3: each rank's ZeRO part starts and ends inside a row group of the stored
    tp=1 piece, so the reads widen to whole groups (only of the rank's slices) and copy the rows it holds."""
    entry = _entry("exp_avg/o", (8192, 1024), "float32", ShardingRule(tp=TpSplit(dim=1)), role="exp_avg")
    tensors = {"exp_avg/o": entry}
    path = str(tmp_path / "c")
    save_full_tensors(path, tensors=tensors, layout=Layout(tp=1), values=_value, model={"arch": "toy", "config": {}})
    full = _value(entry)
    for staged in (False, True):
        monkeypatch.setattr(staging, "STAGE_HOST_MEMORY", staged)
        for rank in range(6):
            stats = LoadStats()
            state = load_rank_state(path, Layout(tp=2, dp=3), rank, stats=stats)
            for box, got in state["exp_avg/o"]:
                assert torch.equal(got, full[box.slices()]), (rank, box)
            # at most a group of 1,024 rows of its half (2 MiB) more at each end
            assert stats.bytes_read <= stats.bytes_needed + 2 * (2 << 20), (rank, stats)


def test_whole_tensors_and_an_offline_reshard_verify_every_slice(tp1, tmp_path):
    reader = CheckpointReader(tp1)
    for name, entry in TENSORS.items():
        assert torch.equal(reader.read_tensor(name), _value(entry)), name
    from moeckpt.reshard.executor import reshard

    reshard(tp1, str(tmp_path / "tp2"), Layout(tp=2))
    back = CheckpointReader(str(tmp_path / "tp2"))
    assert back.index.format_version == 5  # tp=2 pieces are sliced too: 4 of the 8 slices each
    assert _header(str(tmp_path / "tp2"), "rank-00001.safetensors")["__metadata__"]["o@0,512#slices"] == (
        "1:" + ",".join(["128"] * 4)
    )
    for name, entry in TENSORS.items():
        assert torch.equal(back.read_tensor(name), _value(entry)), name
    spec_reader.Checkpoint(str(tmp_path / "tp2")).check()


@pytest.mark.parametrize("session", [False, True], ids=["read-per-piece", "session"])
def test_tensors_of_a_tp2_checkpoint_join_into_a_reused_buffer(tp1, tmp_path, session):
    """read_tensor(out=) assembles the TP halves into the caller's buffer (the export reuses one for every tensor),
    through a read session too (the export's: the halves mapped, verified, copied out once), and refuses a buffer
    of another shape, dtype or layout."""
    from moeckpt.reshard.executor import reshard

    reshard(tp1, str(tmp_path / "tp2"), Layout(tp=2))
    reader = CheckpointReader(str(tmp_path / "tp2"))
    pieces = reader.open_reader() if session else None
    mapped = []
    if pieces is not None:  # every piece is mapped, none read into fresh memory
        map_rows = pieces.map_rows
        pieces.map_rows = lambda ref, lo, hi: mapped.append(ref) or map_rows(ref, lo, hi)  # type: ignore[method-assign]
        pieces.read_rows = None  # type: ignore[assignment]
    scratch = torch.full((max(e.nbytes for e in TENSORS.values()),), 0xAB, dtype=torch.uint8)
    for name, entry in TENSORS.items():
        dtype = _torch_dtype(entry)
        out = scratch[: entry.nbytes].view(dtype).view(entry.shape)
        got = reader.read_tensor(name, out=out, session=pieces)
        assert got.data_ptr() == scratch.data_ptr() and torch.equal(got, _value(entry)), name
    if pieces is not None:
        assert len(mapped) == len([r for r in reader.pieces() if r.box.ndim])
        pieces.close()
    name, entry = next(iter(TENSORS.items()))
    wrong = [
        torch.empty(tuple(reversed(entry.shape)), dtype=_torch_dtype(entry)),
        torch.empty(entry.shape, dtype=torch.float64),
        torch.empty(tuple(reversed(entry.shape)), dtype=_torch_dtype(entry)).t(),
    ]
    assert name == "o" and entry.shape[0] != entry.shape[1]  # so the transposed view is the right shape, strided
    for out in wrong:
        with pytest.raises(ValueError, match="read_box: out is"):
            reader.read_tensor(name, out=out)


def test_a_flipped_byte_in_one_ranks_columns_fails_that_rank_only(tp1, tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(tp1, path)
    info = _header(path)["o@0,0"]
    (n,) = struct.unpack("<Q", open(os.path.join(path, "rank-00000.safetensors"), "rb").read(8))
    row = 1024 * 2
    at = 8 + n + info["data_offsets"][0] + 5000 * row + 700 * 2  # row 5000, column 700: rank 1's half
    with open(os.path.join(path, "rank-00000.safetensors"), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    stats = LoadStats()
    state = load_rank_state(path, Layout(tp=2), 0, tensors=["o"], stats=stats)  # rank 0 never reads that byte
    assert torch.equal(state["o"][0][1], _value(TENSORS["o"])[:, :512])
    with pytest.raises(ChecksumMismatchError, match="slice 5"):
        load_rank_state(path, Layout(tp=2), 1, tensors=["o"])
    with pytest.raises(ChecksumMismatchError):
        CheckpointReader(path).read_tensor("o")
    with pytest.raises(spec_reader.SpecError, match="slice 5 group 2"):
        spec_reader.Checkpoint(path).tensor("o")


def test_a_flipped_byte_fails_a_read_through_a_session_and_names_the_file(tp1, tmp_path):
    """The export's reads (mapped through a read session) verify every byte as the plain reads do: a flipped byte
    in a TP-split tensor's half, or a file cut short, is a typed error naming the file, however the tensor is
    assembled."""
    from moeckpt.reshard.executor import reshard

    reshard(tp1, str(tmp_path / "tp2"), Layout(tp=2))
    path = str(tmp_path / "tp2")
    file = "rank-00001.safetensors"
    info = _header(path, file)["down@0,0,256"]
    (n,) = struct.unpack("<Q", open(os.path.join(path, file), "rb").read(8))
    at = 8 + n + info["data_offsets"][0] + 123 * 4
    with open(os.path.join(path, file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    reader = CheckpointReader(path)
    session = reader.open_reader()
    try:
        assert torch.equal(reader.read_tensor("o", session=session), _value(TENSORS["o"]))  # the other tensors read
        with pytest.raises(ChecksumMismatchError, match=f"{file}.*'down'"):
            reader.read_tensor("down", session=session)
        os.truncate(os.path.join(path, file), 8 + n + info["data_offsets"][0] + 1000)
        with pytest.raises(DataFileError, match=f"{file}.*truncated"):
            reader.read_tensor("down", session=session)
    finally:
        session.close()


@pytest.mark.parametrize("mapped", [False, True], ids=["read-per-row", "mapped"])
def test_a_truncated_file_fails_a_sliced_read_with_a_typed_error(tp1, tmp_path, monkeypatch, mapped):
    if not mapped:
        monkeypatch.setattr(safetensors, "MAPPED_COLUMN_ROWS", 1 << 62)
    path = str(tmp_path / "c")
    shutil.copytree(tp1, path)
    info = _header(path)["o@0,0"]
    (n,) = struct.unpack("<Q", open(os.path.join(path, "rank-00000.safetensors"), "rb").read(8))
    os.truncate(os.path.join(path, "rank-00000.safetensors"), 8 + n + info["data_offsets"][0] + 6000 * 1024 * 2)
    with pytest.raises(DataFileError, match="truncated"):
        load_rank_state(path, Layout(tp=2), 0, tensors=["o"])


def test_the_spec_reader_verifies_version_5_and_the_golden_bytes_are_pinned(tmp_path):
    golden_slices.write(str(tmp_path / "c"))
    for name in FILES:
        with open(os.path.join(GOLDEN, "v5-sliced", name), "rb") as f:
            want = f.read()
        with open(tmp_path / "c" / name, "rb") as f:
            assert f.read() == want, f"{name} differs from tests/golden/v5-sliced: the on-disk format changed"
    values = spec_reader.Checkpoint(os.path.join(GOLDEN, "v5-sliced")).check()
    for name, entry in golden_slices.tensors().items():
        assert torch.equal(torch.from_numpy(values[name].copy()).view(_torch_dtype(entry)), golden_slices.value(entry))


def _torch_dtype(entry: TensorEntry) -> torch.dtype:
    return torch.bfloat16 if entry.dtype == "bfloat16" else torch.float32


def test_version_1_checkpoints_of_the_same_tensors_read_as_before():
    """tests/golden/v1-tp-columns was written by moeckpt before version 5: blocks along the flat bytes."""
    path = os.path.join(GOLDEN, "v1-tp-columns")
    reader = CheckpointReader(path)
    assert reader.index.format_version == 1
    assert all(not r.slices and r.block_bytes == 4 << 20 for r in reader.pieces())
    for name, entry in golden_slices.tensors().items():
        assert torch.equal(reader.read_tensor(name), golden_slices.value(entry)), name
    state = load_rank_state(path, Layout(tp=2), 1)
    assert torch.equal(state["o"][0][1], golden_slices.value(golden_slices.tensors()["o"])[:, 256:])
    spec_reader.Checkpoint(path).check()


def test_slices_in_an_index_of_an_earlier_version_are_refused(tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(os.path.join(GOLDEN, "v5-sliced"), path)
    index = os.path.join(path, "moeckpt.json")
    with open(index) as f:
        text = f.read()
    with open(index, "w") as f:
        f.write(text.replace('"format_version":5', '"format_version":4'))
    with pytest.raises(DataFileError, match="format version 5"):
        CheckpointReader(path).pieces()
    with pytest.raises(spec_reader.SpecError, match="need version 5"):
        spec_reader.Checkpoint(path).pieces()


def test_whole_row_groups_read_in_one_part_verify_in_place_and_catch_a_flipped_byte(tp1, tmp_path):
    """A load's usual read of a sliced piece: whole row groups straight into one buffer. Its slices are checked
    where they landed (no joined copy), the narrow ones gathered through a reused buffer; a flipped byte in one
    narrow slice still fails the read, named."""
    from moeckpt.formats.storages.local import LocalStorage

    path = str(tmp_path / "ck")
    shutil.copytree(tp1, path)
    (ref,) = [r for r in CheckpointReader(path).pieces() if r.tensor == "o"]
    g = ref.geometry
    assert g is not None and g.groups > 1 and g.cols[1] < 1024  # narrow slices, several row groups
    rows = ref.box.shape[0]
    session = safetensors.SafetensorsReader(LocalStorage(path))
    try:
        out = torch.empty(tuple(ref.box.shape), dtype=torch.bfloat16)
        assert session.read_rows_into(ref, 0, rows, out)
        assert torch.equal(out, _value(TENSORS["o"]))
    finally:
        session.close()
    at = ref.start + g.row_bytes * (g.group_rows + 3) + g.cols[5] + 7  # row group 1, slice 5
    with open(os.path.join(path, ref.file), "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))
    session = safetensors.SafetensorsReader(LocalStorage(path))
    try:
        with pytest.raises(ChecksumMismatchError, match="slice 5"):
            session.read_rows_into(ref, 0, rows, torch.empty_like(out))
    finally:
        session.close()


def test_slice_checksums_of_strided_slices_equal_those_of_contiguous_copies():
    """The gather buffer a thread reuses gives each strided slice the checksum of its own contiguous bytes, for
    slices of several sizes in turn (a smaller one after a larger one reads only its own bytes)."""
    import numpy as np
    import xxhash

    from moeckpt.formats.slices import _slice_digest

    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(64, 4096), dtype=np.uint8)
    for c0, c1 in [(0, 2048), (512, 1024), (4000, 4096), (0, 4096), (1, 3)]:
        want = "xxh3_64:" + xxhash.xxh3_64_hexdigest(np.ascontiguousarray(rows[:, c0:c1]).tobytes())
        assert _slice_digest(rows, c0, c1) == want


def test_a_read_from_inside_a_row_group_verifies_across_its_parts(tp1, tmp_path, monkeypatch):
    """Bytes from the middle of a row group (a ZeRO part's cut): the group's rows before them land in scratch,
    the rest in the caller's buffer, and the slices are hashed across the two parts without joining them; a
    flipped byte in either part fails the read."""
    from moeckpt.formats.storages.local import LocalStorage

    path = str(tmp_path / "ck")
    shutil.copytree(tp1, path)
    (ref,) = [r for r in CheckpointReader(path).pieces() if r.tensor == "o"]
    g = ref.geometry
    assert g is not None and g.groups > 2
    a = g.row_bytes * (g.group_rows + 5)  # row 5 of group 1: rows 0-4 of the group go to scratch
    b = g.row_bytes * 3 * g.group_rows
    joined = []
    real = np.concatenate
    monkeypatch.setattr(safetensors.np, "concatenate", lambda *x, **k: joined.append(1) or real(*x, **k))
    full = _value(TENSORS["o"]).reshape(-1).view(torch.uint8)

    def read() -> torch.Tensor:
        session = safetensors.SafetensorsReader(LocalStorage(path))
        try:
            out = torch.empty(b - a, dtype=torch.uint8)
            assert session.read_bytes_into(ref, a, b, out)
            return out
        finally:
            session.close()

    assert torch.equal(read(), full[a:b])
    assert not joined  # a sound read is verified where it landed
    for at in (g.row_bytes * g.group_rows + g.cols[6] + 1, a + g.cols[2] + 3):  # in the scratch, in the buffer
        with open(os.path.join(path, ref.file), "r+b") as f:
            f.seek(ref.start + at)
            byte = f.read(1)
            f.seek(ref.start + at)
            f.write(bytes([byte[0] ^ 0x04]))
        with pytest.raises(ChecksumMismatchError, match="slice"):
            read()
        with open(os.path.join(path, ref.file), "r+b") as f:
            f.seek(ref.start + at)
            f.write(byte)
    assert torch.equal(read(), full[a:b])
