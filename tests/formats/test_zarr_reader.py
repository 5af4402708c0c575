"""The zarr read session (formats/backends/zarr_reader.py): rows read straight into the caller's memory equal what
``read_piece`` returns, for raw and compressed cells, plain chunks and shards, edge cells padded along the rows,
inner chunks split along a later dimension; damaged objects are refused; what it cannot read it hands back."""

from __future__ import annotations

import pytest
import torch

from moeckpt.formats import errors
from moeckpt.formats.backends import zarr as zb
from moeckpt.formats.backends import zarr_cells
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors

from ..helpers import tensors_equal
from .test_zarr_backend import random_value

#: (shape, dtype, dp, inner chunk limit in bytes): plain chunks; shards along rows with an edge cell padded along
#: them (dp=3 over 10 rows); inner chunks of one row split along dim 1 (rows wider than the limit).
CASES = [
    ((10, 6), "bfloat16", 3, 1 << 20),
    ((10, 6), "bfloat16", 3, 24),
    ((24, 16), "float32", 2, 256),
    ((4, 64), "float32", 1, 64),
    ((6, 4, 8), "float32", 2, 128),
]


def _save(tmp_path, monkeypatch, case, compress: str) -> tuple[str, torch.Tensor]:
    shape, dtype, dp, limit = case
    monkeypatch.setattr(zb, "INNER_CHUNK_BYTES", limit)
    entry = TensorEntry(name="exp_avg/w", shape=shape, dtype=dtype, role="exp_avg", param="w")
    value = random_value(entry, seed=len(shape) + dp)
    loc = str(tmp_path / f"ckpt-{compress}")
    save_full_tensors(
        loc,
        tensors={entry.name: entry},
        layout=Layout(dp=dp),
        values=lambda e: value,
        model={"arch": "toy"},
        backend="zarr",
        compress=compress,
    )
    return loc, value


def _no_read_piece(*args, **kwargs):
    raise AssertionError("read through read_piece, not in place")


@pytest.mark.parametrize("compress", ["none", "blosc-zstd"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}-dp{c[2]}-{c[3]}B" for c in CASES])
def test_rows_read_in_place_equal_read_piece(tmp_path, monkeypatch, case, compress):
    loc, value = _save(tmp_path, monkeypatch, case, compress)
    reader = CheckpointReader(loc)
    session = reader.open_reader()
    refs = reader.pieces()
    assert any(r.chunks is not None for r in refs) == (case[3] < 1 << 20)
    monkeypatch.setattr(zarr_cells, "read_piece", _no_read_piece)  # in place reads must not fall back
    for ref in refs:
        rows = ref.box.shape[0]
        want = value[ref.box.slices()]
        plain = ref.chunks is None
        for lo in range(rows):
            for hi in range(lo + 1, rows + 1):
                if plain and (lo, hi) != (0, rows):
                    continue  # some rows of one plain chunk: handed back (below)
                out = torch.empty((hi - lo,) + tuple(ref.box.shape[1:]), dtype=value.dtype)
                assert session.read_rows_into(ref, lo, hi, out), (ref.box, lo, hi)
                assert tensors_equal(out, want[lo:hi]), (ref.box, lo, hi)
    monkeypatch.undo()
    session.close()
    session = CheckpointReader(loc).open_reader()
    for ref in refs:  # read_rows: in place where it can, else read_piece; the same rows either way
        rows = ref.box.shape[0]
        for lo, hi in [(0, rows), (rows // 2, rows), (0, 1)]:
            if hi > lo:
                assert tensors_equal(session.read_rows(ref, lo, hi), value[ref.box.slices()][lo:hi])
    session.close()


def test_what_it_cannot_read_in_place_is_handed_back(tmp_path, monkeypatch):
    loc, value = _save(tmp_path, monkeypatch, CASES[0], "none")
    reader = CheckpointReader(loc)
    session = reader.open_reader()
    ref = reader.pieces()[0]
    assert ref.chunks is None and ref.box.shape[0] == 4
    assert not session.read_rows_into(ref, 0, 4, torch.empty((3, 6), dtype=value.dtype))  # the wrong size
    assert not session.read_rows_into(ref, 0, 4, torch.empty((6, 4), dtype=value.dtype).t())  # not contiguous
    session.close()
    # a storage without direct reads (fsspec memory): every read handed back, read_rows still right
    mem = "memory://zarr-reader/ckpt"
    open_storage(mem).makedirs()
    src = open_storage(loc)
    for rel in src.list_files():
        open_storage(mem).write_bytes(rel, src.read_bytes(rel))
    remote = CheckpointReader(mem)
    session = remote.open_reader()
    ref = remote.pieces()[0]
    assert not session.read_rows_into(ref, 0, 4, torch.empty((4, 6), dtype=value.dtype))
    assert tensors_equal(session.read_rows(ref, 0, 4), value[0:4])
    session.close()


@pytest.mark.parametrize("compress", ["none", "blosc-zstd"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_damaged_objects_are_refused_in_place(tmp_path, monkeypatch, compress, damage):
    loc, value = _save(tmp_path, monkeypatch, CASES[2], compress)
    reader = CheckpointReader(loc)
    ref = reader.pieces()[1]
    assert ref.chunks == (4, 16)  # three inner chunks of 4 rows per 12-row cell
    storage = open_storage(loc)
    raw = bytearray(storage.read_bytes(ref.file))
    if damage == "flip":
        raw[len(raw) - 40] ^= 0x04  # inside the last inner chunk's bytes
    elif damage == "truncate":
        del raw[-3:]
    else:
        raw += b"\0"
    storage.write_bytes(ref.file, bytes(raw))
    session = reader.open_reader()
    out = torch.empty((12, 16), dtype=value.dtype)
    with pytest.raises((errors.ChecksumMismatchError, errors.DataFileError)):
        session.read_rows_into(ref, 0, 12, out)
    session.close()
