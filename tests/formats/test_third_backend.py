"""The backend seam, proved by a format the library does not know: the tests' ``raw`` backend (tests/raw_backend.py).

It passes the shared format suite (test_format_suite.py runs BackendTests over every registered backend); here it
is resharded to and from safetensors and zarr, offline through the CLI and at load time, and verify, diff and
inspect work on it, all without a line of moeckpt naming it.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeckpt.formats.backend import backend_names, get_backend
from moeckpt.formats.checkpoint import CheckpointReader, verify
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state

from ..helpers import flip_byte, tensors_equal
from ..raw_backend import RawBackend

MODEL = ("--model", "zaya-tiny", "--with-optimizer", "--dtype", "bf16", "--seed", "4")


def test_raw_is_registered_everywhere_names_are_listed():
    assert "raw" in backend_names() and isinstance(get_backend("raw"), RawBackend)
    from moeckpt.trainer.train import TrainConfig

    TrainConfig(model="zaya-tiny", run_dir="unused", format="raw")  # the trainer's check asks the registry too
    with pytest.raises(ValueError, match="format='nope' must be one of safetensors, zarr, raw"):
        TrainConfig(model="zaya-tiny", run_dir="unused", format="nope")


def test_offline_reshard_to_and_from_raw_through_the_cli(tmp_path, moeckpt_cli):
    src, raw, zarr, back, raw2 = (str(tmp_path / n) for n in ("src", "raw", "zarr", "back", "raw2"))
    code, _, err = moeckpt_cli("init", src, *MODEL, "--tp", 2, "--ep", 2, "--dp", 2)
    assert code == 0, err
    # safetensors -> raw in another layout
    code, out, err = moeckpt_cli("reshard", src, raw, "--format", "raw", "--tp", 1, "--ep", 2, "--dp", 4)
    assert code == 0, err
    assert "(raw)" in out and "tp=1 ep=2 dp=4" in out
    assert CheckpointReader(raw).index.backend == "raw"
    code, out, err = moeckpt_cli("verify", raw)
    assert code == 0, out + err
    code, out, err = moeckpt_cli("diff", src, raw)
    assert code == 0 and out.startswith("identical"), out + err
    # raw -> zarr -> raw -> safetensors, every step the same logical checkpoint
    assert moeckpt_cli("reshard", raw, zarr, "--format", "zarr", "--tp", 2, "--ep", 1, "--dp", 2)[0] == 0
    assert moeckpt_cli("diff", raw, zarr)[0] == 0
    assert moeckpt_cli("reshard", zarr, raw2, "--format", "raw", "--tp", 1, "--ep", 1, "--dp", 1)[0] == 0
    assert moeckpt_cli("reshard", raw2, back, "--format", "safetensors", "--tp", 2, "--ep", 2, "--dp", 2)[0] == 0
    code, out, err = moeckpt_cli("diff", src, back)
    assert code == 0 and out.startswith("identical"), out + err
    a, b = CheckpointReader(src), CheckpointReader(back)
    for name in a.index.tensors:
        assert tensors_equal(a.read_tensor(name), b.read_tensor(name)), name


def test_inspect_describes_a_raw_checkpoint(tmp_path, moeckpt_cli):
    src, raw = str(tmp_path / "src"), str(tmp_path / "raw")
    assert moeckpt_cli("init", src, *MODEL)[0] == 0
    assert moeckpt_cli("reshard", src, raw, "--format", "raw", "--dp", 2)[0] == 0
    code, out, err = moeckpt_cli("inspect", raw, "--json")
    assert code == 0, err
    info = json.loads(out)
    reader = CheckpointReader(raw)
    pieces = reader.pieces()
    assert info["backend"] == "raw" and info["layout"] == {"tp": 1, "ep": 1, "dp": 2}
    assert info["stored_objects"] == len(reader.index.files) + len(pieces)  # headers and one file per piece
    assert info["stored_bytes"] == sum(f.size for f in reader.index.files.values()) + sum(p.nbytes for p in pieces)
    code, out, err = moeckpt_cli("inspect", raw)
    assert code == 0 and "(raw)" in out, err


def test_verify_names_a_damaged_raw_piece(tmp_path, moeckpt_cli):
    src, raw = str(tmp_path / "src"), str(tmp_path / "raw")
    assert moeckpt_cli("init", src, *MODEL)[0] == 0
    assert moeckpt_cli("reshard", src, raw, "--format", "raw", "--dp", 2)[0] == 0
    ref = max(CheckpointReader(raw).pieces(), key=lambda p: p.nbytes)
    flip_byte(raw, ref.file, ref.nbytes // 2)
    code, out, err = moeckpt_cli("verify", raw)
    assert code == 1 and ref.file in out + err and "checksum mismatch" in out + err, out + err
    assert moeckpt_cli("diff", src, raw)[0] != 0


@pytest.mark.parametrize("target", [Layout(), Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=4, dp=4)], ids=str)
def test_load_time_reshard_from_raw(tmp_path, moeckpt_cli, target):
    """load_rank_state from a raw checkpoint (planned from its placements, reading only the headers of the
    writers it needs) gives every rank exactly its boxes of the safetensors original."""
    src, raw = str(tmp_path / "src"), str(tmp_path / "raw")
    assert moeckpt_cli("init", src, *MODEL, "--tp", 2, "--ep", 2, "--dp", 2)[0] == 0
    assert moeckpt_cli("reshard", src, raw, "--format", "raw", "--tp", 1, "--ep", 2, "--dp", 2)[0] == 0
    original = CheckpointReader(src)
    for rank in range(target.world):
        stats = LoadStats()
        state = load_rank_state(raw, target, rank, stats=stats)
        assert stats.bytes_read >= stats.bytes_needed > 0
        for name, boxes in state.items():
            for box, t in boxes:
                assert tensors_equal(t, original.read_box(name, box)), (name, rank, box)


def test_raw_round_trips_through_load_and_offline_with_zarr(tmp_path, moeckpt_cli):
    """zarr -> raw offline, then a load of the raw checkpoint equals a load of the zarr one, rank by rank."""
    src, raw = str(tmp_path / "src"), str(tmp_path / "raw")
    assert moeckpt_cli("init", src, *MODEL, "--tp", 2, "--ep", 2, "--dp", 2, "--format", "zarr")[0] == 0
    assert moeckpt_cli("reshard", src, raw, "--format", "raw", "--tp", 1, "--ep", 1, "--dp", 2)[0] == 0
    assert verify(CheckpointReader(raw)) == []
    target = Layout(tp=2, ep=1, dp=2)
    for rank in range(target.world):
        a = load_rank_state(src, target, rank)
        b = load_rank_state(raw, target, rank)
        assert a.keys() == b.keys()
        for name in a:
            assert [box for box, _ in a[name]] == [box for box, _ in b[name]]
            assert all(
                torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for (_, x), (_, y) in zip(a[name], b[name])
            )
