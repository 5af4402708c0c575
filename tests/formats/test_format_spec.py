"""docs/format.md is complete: a reader written from it alone (tests/spec_reader.py) reads what every moeckpt writer
writes, verifies every checksum, finds the pieces and writers the spec defines, and agrees with moeckpt bit for bit.

Each of the points where the spec used to be silent is pinned here by a test named for its rule: the version rule,
touching intervals, the order of pieces in a file, empty parts and the writer rotation, the zarr chunk rule for
empty and uncut dimensions, the data-file versions, the roles of state-dict tensors, and ``format=``. The golden
files ``tests/golden/zarr-v1``, ``zarr-v2``, ``v3-stored`` and ``zarr-v3-stored`` pin the bytes of what the older
golden files did not cover (zarr, stored pieces); ``v2-stored`` and ``zarr-v2-stored`` are version 2 as dcp.save wrote it, kept
to be read. Regenerate them with ``python -m tests.formats.test_format_spec`` only
for an intended, versioned format change.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import sys
import zlib

import pytest
import torch

from moeckpt.formats.checkpoint import CheckpointReader, save_pieces, verify
from moeckpt.formats.errors import MoeckptError, UnsupportedVersionError
from moeckpt.formats.index import FORMAT_VERSION, Index, MeshEntry, TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors

from .. import spec_reader as spec
from ..spec_reader import SpecError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden")


def _moeckpt_bytes(reader: CheckpointReader, name: str) -> bytes:
    t = reader.read_tensor(name).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def conforms(path: str, hints: dict | None = None) -> spec.Checkpoint:
    """The spec reader checks everything at ``path`` and reads every tensor as moeckpt does, bit for bit."""
    ckpt = spec.Checkpoint(path)
    values = ckpt.check(hints)
    reader = CheckpointReader(path)
    assert set(values) == set(reader.index.tensors)
    for name, value in values.items():
        assert value.tobytes() == _moeckpt_bytes(reader, name), name
    assert verify(reader) == []
    return ckpt


def boxes_of(path: str) -> dict[str, list[spec.Box]]:
    """Every stored box by tensor, as the spec reader lists them."""
    return {n: [(p.offsets, p.shape) for p in ps] for n, ps in spec.Checkpoint(path).pieces().items()}


def header_keys(path: str, file: str) -> list[str]:
    with open(os.path.join(path, file), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def array_doc(path: str, name: str) -> dict:
    with open(os.path.join(path, name, "zarr.json")) as f:
        return json.load(f)


def _entry(name, shape, dtype="float32", role="param", sharding=None) -> TensorEntry:
    param = name.split("/", 1)[1] if role != "param" else name
    return TensorEntry(name=name, shape=tuple(shape), dtype=dtype, role=role, param=param, sharding=sharding or {})


def _value(entry: TensorEntry) -> torch.Tensor:
    n = math.prod(entry.shape)
    base = float(zlib.crc32(entry.name.encode()) % 1000)
    t = torch.arange(n, dtype=torch.float64) + base
    if entry.dtype == "bool":
        return (t.remainder(3) == 0).reshape(entry.shape)
    if entry.dtype.startswith("float8"):
        return (t.remainder(7) - 3).to(torch.float32).to(getattr(torch, entry.dtype)).reshape(entry.shape)
    return t.to(getattr(torch, entry.dtype)).reshape(entry.shape)


def save_rules(path: str, entries: list[TensorEntry], layout: Layout, backend: str = "safetensors") -> Index:
    return save_full_tensors(
        path,
        tensors={e.name: e for e in entries},
        layout=layout,
        values=_value,
        model={"arch": "toy", "config": {}},
        backend=backend,
    )


# -- every writer's checkpoints conform ---------------------------------------------------------------------------

INIT_LAYOUTS = [
    ("zaya-tiny", 1, 1, 1),
    ("zaya-tiny", 2, 2, 2),
    ("zaya-tiny", 1, 1, 3),
    ("zaya-tiny", 2, 1, 3),
    ("zaya-tiny", 1, 2, 2),
    ("qwen3moe-tiny", 2, 2, 4),
]


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
@pytest.mark.parametrize("model,tp,ep,dp", INIT_LAYOUTS)
def test_checkpoints_of_moeckpt_init_conform_and_read_alike(tmp_path, moeckpt_cli, model, tp, ep, dp, fmt):
    path = str(tmp_path / "c")
    args = ["init", path, "--model", model, "--tp", tp, "--ep", ep, "--dp", dp, "--format", fmt]
    code, _, err = moeckpt_cli(*args, "--with-optimizer", "--dtype", "bf16")
    assert code == 0, err
    ckpt = conforms(path)
    # zaya and qwen3_moe split row-parallel weights along dim 1: at tp < 8 their safetensors pieces are
    # checksummed in slices of the split (version 5); zarr does not slice and stays version 1
    assert ckpt.version == (5 if fmt == "safetensors" else 1)
    assert {e.role for e in ckpt.entries.values()} >= {"param", "master", "exp_avg"}


def _state_dict() -> dict:
    """A state dict of every kind of leaf: dtypes, a 0-d and an empty tensor, names with '@' and non-ASCII
    characters, JSON values (a NaN among them)."""
    return {
        "model": {
            "w": torch.arange(24.0).reshape(6, 4),
            "b": torch.arange(4, dtype=torch.bfloat16) + 100,
            "h": torch.arange(6, dtype=torch.float16).reshape(2, 3),
            "f8": torch.tensor([0.5, -1.0, 2.0]).to(torch.float8_e4m3fn),
            "ids": torch.arange(5, dtype=torch.int64) - 2,
            "mask": torch.tensor([True, False, True]),
            "été@v2": torch.arange(3.0),
        },
        "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(6, 4)}}},
        "empty": torch.zeros(0, 3),
        "step": 5,
        "loss": float("nan"),
        "sched": {"lr": 0.1, "milestones": [1, 2]},
    }


def _dcp_save(sd: dict, path: str, fmt: str) -> None:
    import torch.distributed.checkpoint as dcp

    import moeckpt.dcp

    dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt, step=5))


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_state_dicts_saved_by_one_process_conform_and_read_alike(tmp_path, fmt):
    import moeckpt

    moeckpt.save(_state_dict(), str(tmp_path / "save"), format=fmt, step=5)
    conforms(str(tmp_path / "save"))
    _dcp_save(_state_dict(), str(tmp_path / "dcp-safetensors"), "safetensors")
    hints = boxes_of(str(tmp_path / "dcp-safetensors"))
    _dcp_save(_state_dict(), str(tmp_path / "dcp"), fmt)
    conforms(str(tmp_path / "dcp"), hints if fmt == "zarr" else None)


# -- 1. the version rule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "zarr"])
def test_storage_writer_checkpoints_are_version_3_without_meshes(tmp_path, fmt):
    _dcp_save(_state_dict(), str(tmp_path / "c"), fmt)
    index = json.load(open(tmp_path / "c" / "moeckpt.json"))
    assert index["format_version"] == 3 and "meshes" not in index and "dcp" in index["model"]["config"]
    assert {json.dumps(e["sharding"]) for e in index["tensors"].values()} == {'{"pieces": "stored"}'}
    assert CheckpointReader(str(tmp_path / "c")).index.format_version == 3


def test_a_version_3_dtype_makes_any_index_version_3(tmp_path):
    import moeckpt

    moeckpt.save({"w": torch.ones(4, dtype=torch.int32).to(torch.uint16)}, str(tmp_path / "s"))
    assert json.load(open(tmp_path / "s" / "moeckpt.json"))["format_version"] == 3
    assert spec.Checkpoint(str(tmp_path / "s")).version == 3


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d["tensors"]["model.w"].update(dtype="uint32"),
        lambda d: d["model"]["config"].update(dcp={"version": "1.0.0"}),
    ],
    ids=["version-3-dtype", "model-config-dcp"],
)
def test_both_readers_refuse_what_version_3_added_in_a_version_2_index(tmp_path, edit):
    dst = shutil.copytree(os.path.join(GOLDEN, "v2-stored"), str(tmp_path / "c"))
    doc = json.load(open(os.path.join(dst, "moeckpt.json")))
    edit(doc)
    with open(os.path.join(dst, "moeckpt.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(MoeckptError, match="version 3"):
        CheckpointReader(dst)
    with pytest.raises(SpecError, match="version 3"):
        spec.Checkpoint(dst)


def test_only_a_version_3_index_of_dcp_save_has_escaped_names(tmp_path):
    """A name of ``moeckpt.save`` (or of a version-2 ``dcp.save``) is its key as it stands, '%' and all; only
    ``model.config.dcp`` (version 3) says the names are escaped keys."""
    import torch.distributed.checkpoint as dcp

    import moeckpt
    import moeckpt.dcp

    state = {"a%41": torch.arange(3.0), "b:c": torch.ones(2)}
    moeckpt.save(state, str(tmp_path / "save"))
    _dcp_save(state, str(tmp_path / "dcp"), "safetensors")
    assert sorted(json.load(open(tmp_path / "save" / "moeckpt.json"))["tensors"]) == ["a%41", "b:c"]
    assert sorted(json.load(open(tmp_path / "dcp" / "moeckpt.json"))["tensors"]) == ["a%2541", "b%3Ac"]
    for path in ("save", "dcp"):
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, storage_reader=moeckpt.dcp.StorageReader(str(tmp_path / path)))
        assert all(torch.equal(back[k], state[k]) for k in state), path
        assert spec.dcp_keys(spec.Checkpoint(str(tmp_path / path)).doc) == {
            "a%41": "a%41" if path == "save" else "a%2541",
            "b:c": "b:c" if path == "save" else "b%3Ac",
        }


@pytest.mark.parametrize("name", ["v2-stored", "zarr-v2-stored"])
def test_a_version_2_checkpoint_of_dcp_save_loads_through_dcp_as_saved(name):
    """The stored-piece goldens of version 2 (what dcp.save wrote before version 3) stay readable, values and all."""
    import torch.distributed.checkpoint as dcp

    import moeckpt.dcp

    want = _stored_state()
    back = {
        "model": {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "optim": {"state": {"w": {"step": torch.tensor(0.0)}}, "param_groups": [{"lr": 0.0, "params": []}]},
        "empty": torch.ones(0, 3),
        "step": 0,
        "loss": 0.0,
    }
    dcp.load(back, storage_reader=moeckpt.dcp.StorageReader(os.path.join(GOLDEN, name)))
    assert torch.equal(back["model"]["w"], want["model"]["w"]) and torch.equal(back["model"]["b"], want["model"]["b"])
    assert torch.equal(back["optim"]["state"]["w"]["step"], want["optim"]["state"]["w"]["step"])
    assert back["optim"]["param_groups"] == want["optim"]["param_groups"] and back["step"] == 5
    assert math.isnan(back["loss"]) and back["empty"].shape == (0, 3)


def test_moeckpt_save_is_version_2_with_meshes_and_layout_checkpoints_stay_version_1(tmp_path):
    import moeckpt

    moeckpt.save({"w": torch.ones(2)}, str(tmp_path / "s"))
    index = json.load(open(tmp_path / "s" / "moeckpt.json"))
    assert index["format_version"] == 2 and index["meshes"] == [{"shape": [1], "ranks": [0]}]
    save_rules(str(tmp_path / "r"), [_entry("w", [4, 2], sharding={"tp": {"dim": 0}})], Layout(tp=2))
    index = json.load(open(tmp_path / "r" / "moeckpt.json"))
    assert index["format_version"] == 1 and "meshes" not in index


def _copy_v1_golden(dst: str) -> str:
    """tests/golden's own files (its subfolders are other checkpoints)."""
    return shutil.copytree(GOLDEN, dst, ignore=lambda d, names: [n for n in names if os.path.isdir(os.path.join(d, n))])


def _edited_index(tmp_path, edit) -> str:
    dst = _copy_v1_golden(str(tmp_path / "edited"))
    doc = json.load(open(os.path.join(dst, "moeckpt.json")))
    edit(doc)
    with open(os.path.join(dst, "moeckpt.json"), "w") as f:
        json.dump(doc, f)
    return dst


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(format_version=FORMAT_VERSION + 1),
        lambda d: d.update(format_version=0),
        lambda d: d.update(format_version="1"),
        lambda d: d.update(meshes=[{"shape": [1], "ranks": [0]}]),
    ],
    ids=["version-above-known", "version-0", "version-as-string", "meshes-in-version-1"],
)
def test_both_readers_refuse_unknown_versions_and_meshes_in_version_1(tmp_path, edit):
    path = _edited_index(tmp_path, edit)
    with pytest.raises(MoeckptError):
        CheckpointReader(path)
    with pytest.raises(SpecError):
        spec.Checkpoint(path)


def test_a_version_above_the_known_ones_says_upgrade(tmp_path):
    path = _edited_index(tmp_path, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(UnsupportedVersionError, match="upgrade moeckpt"):
        CheckpointReader(path)


def test_a_version_2_reader_reads_version_1_and_takes_the_version_from_the_index_alone(tmp_path):
    """Layout-rule tensors read the same under index version 2; the data files say 1 either way."""
    path = _edited_index(tmp_path, lambda d: d.update(format_version=2))
    reader = CheckpointReader(path)
    assert reader.index.format_version == 2
    ckpt = spec.Checkpoint(path)
    for name in ckpt.entries:
        assert ckpt.tensor(name).tobytes() == _moeckpt_bytes(reader, name)


# -- 2. touching intervals ----------------------------------------------------------------------------------------


def test_a_fused_dimension_at_tp_1_is_one_box_and_one_zarr_chunk(tmp_path, moeckpt_cli):
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"  # blocks [64, 64] along dim 1, 4 experts along dim 0
    for fmt in ("safetensors", "zarr"):
        path = str(tmp_path / fmt)
        assert moeckpt_cli("init", path, "--model", "zaya-tiny", "--ep", 2, "--dp", 2, "--format", fmt)[0] == 0
        if fmt == "safetensors":
            assert sorted(boxes_of(path)[gate_up]) == [((0, 0, 0), (2, 128, 64)), ((2, 0, 0), (2, 128, 64))]
        else:
            assert array_doc(path, gate_up)["chunk_grid"]["configuration"]["chunk_shape"] == [2, 128, 64]


def test_at_tp_2_every_block_is_a_box_and_a_zero_part_across_blocks_is_two(tmp_path):
    conv = _entry("master/conv", [96, 2], role="master", sharding={"tp": {"dim": 0, "blocks": [64, 32]}})
    save_rules(str(tmp_path / "tp2"), [conv], Layout(tp=2, dp=2))
    # tp_rank 0 holds rows [0, 32) and [64, 80): 48 local rows, ZeRO parts of 24 rows; part 1 crosses the blocks
    assert sorted(boxes_of(str(tmp_path / "tp2"))["master/conv"]) == [
        ((0, 0), (24, 2)),
        ((24, 0), (8, 2)),
        ((32, 0), (24, 2)),
        ((56, 0), (8, 2)),
        ((64, 0), (16, 2)),
        ((80, 0), (16, 2)),
    ]
    save_rules(str(tmp_path / "tp1"), [conv], Layout(tp=1, dp=2))
    # at tp 1 the rule is one box; part 1, rows [48, 96), crosses the block boundary at 64 and stays one box
    assert sorted(boxes_of(str(tmp_path / "tp1"))["master/conv"]) == [((0, 0), (48, 2)), ((48, 0), (48, 2))]


def test_a_strided_shard_over_a_mesh_dimension_of_size_1_keeps_touching_boxes():
    from moeckpt.reshard.mesh import entry_pieces

    mesh = MeshEntry((1, 2), (0, 1))
    entry = TensorEntry(
        name="x", shape=(4, 4), dtype="float32", role="param", param="x",
        sharding={"mesh": 0, "placements": ["SS(0,2)", "R"]}, mesh=mesh,
    )  # fmt: skip
    doc = {"meshes": [mesh.to_json()]}
    mine = spec.Entry("x", (4, 4), "float32", "param", "x", entry.sharding, "mesh")
    want = [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    assert spec.mesh_boxes(mine, doc["meshes"][0], 0) == want == spec.mesh_boxes(mine, doc["meshes"][1 - 1], 1)
    assert [(b.offsets, b.shape) for b, _ in entry_pieces(entry)] == want


# -- 3. the order of pieces in a file -----------------------------------------------------------------------------


def _read_file(path: str, file: str) -> tuple[dict, list[tuple[str, dict, bytes]]]:
    """A safetensors file's ``__metadata__`` and its pieces ``(key, header entry, bytes)`` in file order."""
    raw = open(os.path.join(path, file), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    return meta, [(k, v, raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]) for k, v in head.items()]


def _write_file(path: str, file: str, meta: dict, pieces: list[tuple[str, dict, bytes]]) -> None:
    """Write a safetensors file of ``pieces`` in the given order (offsets renumbered), and its index entry."""
    new, pos, body = {"__metadata__": meta}, 0, b""
    for key, info, data in pieces:
        new[key] = {**info, "data_offsets": [pos, pos + len(data)]}
        pos, body = pos + len(data), body + data
    text = json.dumps(new, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = struct.pack("<Q", len(text)) + text + body
    open(os.path.join(path, file), "wb").write(blob)
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    index["files"][file] = {"size": len(blob), "checksum": spec.checksum(blob[: 8 + len(text)])}
    json.dump(index, open(os.path.join(path, "moeckpt.json"), "w"))


def _rewrite(path: str, file: str, order) -> None:
    """Rewrite one safetensors file of ``path`` with its pieces in ``order(pieces)``."""
    meta, pieces = _read_file(path, file)
    _write_file(path, file, meta, order(pieces))


def test_pieces_may_come_in_any_order_in_a_file(tmp_path, moeckpt_cli):
    path = str(tmp_path / "c")
    assert moeckpt_cli("init", path, "--model", "zaya-tiny", "--with-optimizer", "--dp", 2)[0] == 0
    before = spec.Checkpoint(path)
    reference = {n: before.tensor(n).tobytes() for n in before.entries}
    keys = header_keys(path, "rank-00000.safetensors")
    _rewrite(path, "rank-00000.safetensors", lambda pieces: pieces[::-1])
    _rewrite(path, "rank-00001.safetensors", lambda pieces: random.Random(0).sample(pieces, len(pieces)))
    assert header_keys(path, "rank-00000.safetensors") == keys[::-1]
    conforms(path)
    reader = CheckpointReader(path)
    assert all(_moeckpt_bytes(reader, n) == v for n, v in reference.items())


def test_a_header_whose_member_order_is_not_the_data_order_is_refused(tmp_path):
    path = str(tmp_path / "c")
    shutil.copytree(os.path.join(GOLDEN, "v2"), path)
    file = "rank-00000.safetensors"
    raw = open(os.path.join(path, file), "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    keys = [k for k in head if k != "__metadata__"]
    assert len(keys) >= 2
    # the same bytes, the members listed in another order than their data_offsets
    swapped = {"__metadata__": head["__metadata__"], keys[1]: head[keys[1]], keys[0]: head[keys[0]]}
    swapped.update({k: head[k] for k in keys[2:]})
    text = json.dumps(swapped, separators=(",", ":")).encode()
    assert len(text) <= n
    blob = raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :]
    open(os.path.join(path, file), "wb").write(blob)
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    index["files"][file]["checksum"] = spec.checksum(blob[: 8 + n])
    json.dump(index, open(os.path.join(path, "moeckpt.json"), "w"))
    with pytest.raises(SpecError, match="order rule"):
        spec.Checkpoint(path).pieces()
    assert any("do not match its shape and order" in p for p in verify(CheckpointReader(path)))


# -- 4. empty parts, the box order, the writer rotation -----------------------------------------------------------


def test_empty_parts_are_never_stored_nor_numbered(tmp_path):
    rows2 = _entry("exp_avg/x", [2, 3], role="exp_avg", sharding={})  # ZeRO over dp=4: parts 2 and 3 are empty
    window = _entry("v", [2, 3], sharding={"tp": {"dim": 0, "window": [0, 4]}})  # tp_rank 1 holds none of it
    path = str(tmp_path / "c")
    save_rules(path, [rows2, window], Layout(tp=2, dp=4))
    stored = spec.Checkpoint(path).pieces()
    assert sorted((p.offsets, p.shape) for p in stored["exp_avg/x"]) == [((0, 0), (1, 3)), ((1, 0), (1, 3))]
    # "v" is one box, held by the ranks with tp_rank 0, written by holders[(crc32("v") + 0) % 4]: the empty box of
    # the ranks with tp_rank 1 is not box 0
    (piece,) = stored["v"]
    holders = [0, 2, 4, 6]
    assert piece.file == f"rank-{holders[zlib.crc32(b'v') % 4]:05d}.safetensors"
    assert piece.file != f"rank-{holders[(zlib.crc32(b'v') + 1) % 4]:05d}.safetensors"
    conforms(path)


def test_the_writer_rotation_hashes_the_names_utf8_bytes_and_numbers_boxes_by_offsets(tmp_path):
    names = ["é/w", "mø@1/x", "名前.w", "plain.w"]
    entries = [_entry(n, [6, 2], sharding={"tp": {"dim": 0}}) for n in names]
    path = str(tmp_path / "c")
    save_rules(path, entries, Layout(tp=2, dp=3))
    stored = spec.Checkpoint(path).pieces()
    differs = False
    for name in names:
        for i, piece in enumerate(sorted(stored[name], key=lambda p: p.offsets)):  # box i: tp_rank i, dp ranks 0-2
            holders = [d * 2 + i for d in range(3)]
            assert piece.file == f"rank-{holders[(zlib.crc32(name.encode('utf-8')) + i) % 3]:05d}.safetensors"
            other = zlib.crc32(name.encode("utf-16-le")) + i
            differs |= piece.file != f"rank-{holders[other % 3]:05d}.safetensors"
    assert differs  # the encoding matters for these names: the test tells UTF-8 from another
    conforms(path)


def test_a_piece_outside_its_writers_file_breaks_the_spec_and_moeckpts_loads(tmp_path):
    """The writer rule is normative: moeckpt's loader opens only the files the rule names."""
    import moeckpt

    path = str(tmp_path / "c")
    save_rules(path, [_entry("w", [4, 2], sharding={"tp": {"dim": 0}})], Layout(tp=2, dp=2))
    # box 0 (rows 0-1) is held by ranks 0 and 2 and written by rank 0; store it in rank 2's file instead
    meta0, pieces0 = _read_file(path, "rank-00000.safetensors")
    meta2, pieces2 = _read_file(path, "rank-00002.safetensors")
    assert [k for k, _, _ in pieces0] == ["w@0,0"] and pieces2 == []
    moved = [(k, v, d) for k, v, d in pieces0]
    meta2.update({k: meta0.pop(k) for k, _, _ in moved})
    _write_file(path, "rank-00000.safetensors", meta0, [])
    _write_file(path, "rank-00002.safetensors", meta2, moved)
    reader = CheckpointReader(path)
    assert verify(reader) == []  # every piece is still there, once, checksummed
    with pytest.raises(SpecError, match="writer is rank-00000"):
        spec.Checkpoint(path).check()
    with pytest.raises(MoeckptError, match="no stored piece of 'w'"):
        moeckpt.load({"w": torch.zeros(4, 2)}, path)


# -- 5. the zarr chunk rule ---------------------------------------------------------------------------------------


def test_zarr_chunks_of_empty_uncut_0_d_and_overhanging_dimensions(tmp_path):
    entries = [
        _entry("zero", [0, 3]),
        _entry("scalar", []),
        _entry("uncut", [5, 7]),
        _entry("exp_avg/uneven", [7, 2], role="exp_avg"),  # ZeRO over dp=3: 3 + 3 + 1 rows
        _entry("big", [1100, 1024]),  # one 4.5 MB cell: the sharding codec, 550-row inner chunks
    ]
    path = str(tmp_path / "c")
    save_rules(path, entries, Layout(dp=3), backend="zarr")
    grid = {e.name: array_doc(path, e.name)["chunk_grid"]["configuration"]["chunk_shape"] for e in entries}
    assert grid == {"zero": [1, 3], "scalar": [], "uncut": [5, 7], "exp_avg/uneven": [3, 2], "big": [1100, 1024]}
    sharding = array_doc(path, "big")["codecs"][0]
    assert sharding["name"] == "sharding_indexed" and sharding["configuration"]["chunk_shape"] == [550, 1024]
    assert os.path.exists(os.path.join(path, "scalar", "c")) and not os.path.exists(os.path.join(path, "zero", "c"))
    assert sorted(os.listdir(os.path.join(path, "exp_avg/uneven", "c"))) == ["0", "1", "2"]
    conforms(path)
    save_rules(str(tmp_path / "st"), entries, Layout(dp=3))
    (big,) = spec.Checkpoint(str(tmp_path / "st")).pieces()["big"]
    assert len(big.sums) == 2  # 4,505,600 bytes: two checksum blocks, the last short
    conforms(str(tmp_path / "st"))


# -- 6. data-file versions ----------------------------------------------------------------------------------------


def test_data_file_versions_stay_1_under_a_version_2_index(tmp_path):
    import moeckpt

    for fmt in ("safetensors", "zarr"):
        path = str(tmp_path / fmt)
        moeckpt.save({"w": torch.ones(2), "b": torch.ones(2, dtype=torch.bfloat16)}, path, format=fmt)
        assert json.load(open(os.path.join(path, "moeckpt.json")))["format_version"] == 2
        if fmt == "safetensors":
            ckpt = spec.Checkpoint(path)
            assert ckpt.header("rank-00000.safetensors")[0]["__metadata__"]["moeckpt.format_version"] == "1"
        else:
            assert array_doc(path, "b")["attributes"] == {"moeckpt": {"dtype": "bfloat16", "format_version": 1}}
            assert "moeckpt.dtype" not in array_doc(path, "b")["attributes"]
            root = json.load(open(os.path.join(path, "zarr.json")))
            assert root["attributes"] == {"moeckpt": {"index": "moeckpt.json", "format_version": 1}}
        conforms(path)


def test_a_safetensors_reader_may_ignore_the_data_file_version(tmp_path):
    """moeckpt reads a file whose data-file version says something else: the index alone gives the version."""
    path = str(tmp_path / "c")
    _copy_v1_golden(path)
    _rewrite(path, "rank-00000.safetensors", lambda pieces: pieces)  # rewritten as is, then the marker changed:
    raw = bytearray(open(os.path.join(path, "rank-00000.safetensors"), "rb").read())
    at = raw.index(b'"moeckpt.format_version":"1"') + len(b'"moeckpt.format_version":"')
    raw[at : at + 1] = b"9"
    open(os.path.join(path, "rank-00000.safetensors"), "wb").write(raw)
    index = json.load(open(os.path.join(path, "moeckpt.json")))
    (n,) = struct.unpack("<Q", raw[:8])
    index["files"]["rank-00000.safetensors"]["checksum"] = spec.checksum(bytes(raw[: 8 + n]))
    json.dump(index, open(os.path.join(path, "moeckpt.json"), "w"))
    reader = CheckpointReader(path)
    assert verify(reader) == []
    assert torch.equal(reader.read_tensor("w"), torch.arange(8, dtype=torch.float32).reshape(4, 2))


# -- 7. roles of state-dict tensors -------------------------------------------------------------------------------


def _optimizer_state() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}


@pytest.mark.parametrize("writer", ["save", "dcp"])
def test_every_tensor_of_a_state_dict_is_role_param_of_itself(tmp_path, writer):
    import moeckpt

    path = str(tmp_path / "c")
    if writer == "save":
        moeckpt.save(_optimizer_state(), path)
    else:
        _dcp_save(_optimizer_state(), path, "safetensors")
    tensors = json.load(open(os.path.join(path, "moeckpt.json")))["tensors"]
    assert {"optim.state.0.exp_avg", "optim.state.0.exp_avg_sq", "optim.state.0.step", "model.weight"} <= set(tensors)
    assert all(e["role"] == "param" and e["param"] == name for name, e in tensors.items())


# -- 8. format= is documented -------------------------------------------------------------------------------------


def test_the_library_guide_documents_format_for_save_and_the_storage_writer():
    text = open(os.path.join(ROOT, "docs", "library.md")).read()
    for call in ('moeckpt.save(sd, path, format="zarr")', 'moeckpt.dcp.StorageWriter(path, format="zarr")'):
        assert call in text, call


# -- the index's JSON ---------------------------------------------------------------------------------------------


def test_a_nan_value_is_written_as_the_nan_literal_and_both_readers_accept_it(tmp_path):
    import moeckpt

    moeckpt.save({"w": torch.ones(1), "loss": float("nan"), "top": float("inf")}, str(tmp_path / "c"))
    text = open(tmp_path / "c" / "moeckpt.json").read()
    assert '"loss":NaN' in text and '"top":Infinity' in text
    assert math.isnan(CheckpointReader(str(tmp_path / "c")).index.train_state["loss"])
    assert math.isnan(spec.Checkpoint(str(tmp_path / "c")).doc["train_state"]["loss"])


# -- moeckpt's planners against the spec's definitions ------------------------------------------------------------


def _random_rule(rng: random.Random, tp: int, ep: int):
    ndim = rng.choice([0, 1, 2, 3])
    shape = [rng.choice([0, 1, 2, 3, 4, 6, 8]) * (tp * ep if rng.random() < 0.8 else 1) for _ in range(ndim)]
    rule: dict = {}
    dims = list(range(ndim))
    rng.shuffle(dims)
    if dims and rng.random() < 0.5:
        rule["expert_dim"] = dims.pop()
        shape[rule["expert_dim"]] = ep * rng.choice([1, 2, 3])
    if dims and rng.random() < 0.7:
        d = dims.pop()
        kind = rng.choice(["plain", "blocks", "window"])
        if kind == "blocks":
            blocks = [tp * rng.choice([0, 1, 2, 3]) for _ in range(rng.choice([1, 2, 3]))]
            shape[d] = sum(blocks)
            rule["tp"] = {"dim": d, "blocks": blocks}
        elif kind == "window":
            total = tp * rng.choice([1, 2, 4])
            size = rng.randint(0, total)
            shape[d] = size
            rule["tp"] = {"dim": d, "window": [rng.randint(0, total - size), total]}
        else:
            shape[d] = tp * rng.choice([0, 1, 2, 3])
            rule["tp"] = {"dim": d}
    return shape, rule


def test_layout_placements_are_the_specs_for_random_rules_and_layouts():
    from moeckpt.reshard.placement import placements

    rng = random.Random(37)
    for case in range(400):
        tp, ep = rng.choice([1, 2, 3]), rng.choice([1, 2])
        layout = Layout(tp=tp, ep=ep, dp=ep * rng.choice([1, 2, 3]))
        shape, rule = _random_rule(rng, tp, ep)
        role = rng.choice(["param", "exp_avg", "master", "buffer"])
        name = rng.choice(["w", "exp_avg/é", "x@1"]) + str(case)
        entry = _entry(name if role == "param" else f"{role}/{name}", shape, role=role, sharding=rule)
        doc = {"layout": layout.to_json()}
        mine = spec.Entry(entry.name, entry.shape, "float32", role, entry.param, rule, "rule")
        want = spec.expected_pieces(doc, mine)
        got = {(p.box.offsets, p.box.shape): p.writer for p in placements(entry, layout)}
        assert got == want, (layout, shape, rule, role)


def test_mesh_pieces_are_the_specs_for_random_meshes_and_placements():
    from moeckpt.reshard.mesh import entry_pieces

    rng = random.Random(37)
    for case in range(400):
        mshape = tuple(rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 2, 3])))
        ranks = list(range(10, 10 + math.prod(mshape)))
        rng.shuffle(ranks)
        mesh = MeshEntry(mshape, tuple(ranks))
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.choice([0, 1, 2])))
        options = (
            ["R"]
            + [f"S({d})" for d in range(len(shape))]
            + [f"SS({d},{f})" for d in range(len(shape)) for f in (1, 2, 3)]
        )
        placements = [rng.choice(options) for _ in mshape]
        sharding = {"mesh": 0, "placements": placements}
        name = f"t{case}"
        entry = TensorEntry(
            name=name, shape=shape, dtype="float32", role="param", param=name, sharding=sharding, mesh=mesh
        )
        mine = spec.Entry(name, shape, "float32", "param", name, sharding, "mesh")
        want = spec.expected_pieces({"meshes": [mesh.to_json()]}, mine)
        got = {(b.offsets, b.shape): w for b, w in entry_pieces(entry)}
        assert got == want, (mshape, shape, placements)


# -- golden files of zarr and of stored pieces --------------------------------------------------------------------


def _zarr_v1(location: str) -> None:
    entries = [
        _entry("w", [4, 2], sharding={"tp": {"dim": 0}}),
        _entry("exp_avg/w", [4, 2], role="exp_avg", sharding={"tp": {"dim": 0}}),
        _entry("exp_avg/u", [5, 2], role="exp_avg"),
        _entry("norm", [3], dtype="bfloat16"),
        _entry("scale", []),
        _entry("none", [0, 2]),
    ]
    save_full_tensors(
        location,
        tensors={e.name: e for e in entries},
        layout=Layout(tp=2, dp=2),
        values=_value,
        model={"arch": "toy", "config": {"hidden_size": 2}},
        backend="zarr",
        step=3,
        train_state={"step": 3},
    )


def _zarr_v2(location: str) -> None:
    """The state of tests/golden/v2 (four ranks on a 2 x 2 mesh), stored with the zarr backend."""
    from moeckpt.reshard.mesh import entry_pieces

    with open(os.path.join(GOLDEN, "v2", "moeckpt.json"), "rb") as f:
        index = Index.loads(f.read(), "golden v2")
    index = Index(**{**index.__dict__, "backend": "zarr", "files": {}})
    full = {name: CheckpointReader(os.path.join(GOLDEN, "v2")).read_tensor(name) for name in index.tensors}
    by_writer: dict[int, list[Piece]] = {r: [] for r in range(4)}
    for name, entry in index.tensors.items():
        for box, writer in entry_pieces(entry):
            by_writer[writer].append(Piece(name, box, full[name][box.slices()]))
    save_pieces(location, index, by_writer)


def _stored_state() -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(4, dtype=torch.bfloat16)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": ["w"]}]},
        "empty": torch.zeros(0, 3),
        "step": 5,
        "loss": float("nan"),
    }


def _v3_state() -> dict:
    """The stored state with what version 3 added: keys that need escapes, its dtypes, a bytes value."""
    return {
        **_stored_state(),
        "rng:state%": torch.tensor([1, 2, 65535], dtype=torch.int32).to(torch.uint16),
        "spectrum": torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64),
        "blob": b"\x00moeckpt\xff",
    }


def _v3_stored(location: str) -> None:
    _dcp_save(_v3_state(), location, "safetensors")


def _zarr_v3_stored(location: str) -> None:
    _dcp_save(_v3_state(), location, "zarr")


#: the goldens today's writers write (regenerated and compared byte for byte). tests/golden/v2-stored and
#: zarr-v2-stored are what dcp.save wrote as version 2, before version 3: no writer makes them any more, so they
#: are read, not regenerated (test_a_version_2_checkpoint_of_dcp_save_loads_through_dcp_as_saved).
GOLDENS = {"zarr-v1": _zarr_v1, "zarr-v2": _zarr_v2, "v3-stored": _v3_stored, "zarr-v3-stored": _zarr_v3_stored}


def _files(root: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = open(p, "rb").read()
    return out


def _pieces_by_key(path: str) -> dict[str, tuple]:
    """Every piece of a safetensors checkpoint by key: its header entry (less the offsets), sums and bytes."""
    ckpt = spec.Checkpoint(path)
    out = {}
    for name, pieces in ckpt.pieces().items():
        for p in pieces:
            out[f"{name}@{','.join(map(str, p.offsets))}"] = (p.file, p.shape, p.sums, ckpt.piece_bytes(p))
    return out


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_golden_files_of_zarr_and_stored_pieces(tmp_path, name):
    GOLDENS[name](str(tmp_path / "c"))
    want, got = _files(os.path.join(GOLDEN, name)), _files(str(tmp_path / "c"))
    if name == "v3-stored":
        # DCP's order of write items is not part of the format: the pieces are compared by key, and the index
        # but for the files' header checksums
        assert _pieces_by_key(str(tmp_path / "c")) == _pieces_by_key(os.path.join(GOLDEN, name))
        strip = lambda raw: {**json.loads(raw), "files": sorted(json.loads(raw)["files"])}  # noqa: E731
        assert strip(got["moeckpt.json"]) == strip(want["moeckpt.json"])
        return
    assert sorted(got) == sorted(want)
    for path in want:
        assert got[path] == want[path], f"tests/golden/{name}/{path} differs: the on-disk format changed"


@pytest.mark.parametrize("name", ["", "v2", "v2-stored", "zarr-v2-stored", *sorted(GOLDENS)])
def test_every_golden_checkpoint_conforms_to_the_spec(name):
    path = os.path.join(GOLDEN, name) if name else GOLDEN
    hints = {"zarr-v2-stored": "v2-stored", "zarr-v3-stored": "v3-stored"}.get(name)
    ckpt = conforms(path, boxes_of(os.path.join(GOLDEN, hints)) if hints else None)
    assert ckpt.version == (1 if name in ("", "zarr-v1") else 3 if name.endswith("v3-stored") else 2)


# -- real ranks (slow) --------------------------------------------------------------------------------------------

MESH_2X2 = {
    "w": ([6, 4], "float32", ["SS(0,2)", "S(0)"]),  # FSDP2 + TP
    "b": ([5], "bfloat16", ["S(0)", "R"]),  # uneven
    "r": ([3, 2], "float32", ["R", "S(1)"]),
    "u": ([3], "float32", ["S(0)", "S(0)"]),  # one position holds nothing
    "z": ([0, 4], "float32", ["S(0)", "R"]),
    "t": ([], "float32", ["R", "R"]),
    "e": ([4, 4], "float16", ["S(1)", "S(0)"]),
}
MESH_1X2 = {
    "w": ([6, 4], "float32", ["SS(0,2)", "S(0)"]),
    "x": ([4, 4], "float32", ["SS(0,2)", "R"]),  # touching intervals on every position: two boxes each
    "v": ([4, 4], "float32", ["S(0)", "SS(1,2)"]),
}


@pytest.mark.slow
def test_mesh_saves_of_real_ranks_conform_on_both_backends(tmp_path):
    from moeckpt.trainer.local_world import run_local_world

    from ..format_spec_workers import save_each_way

    run_local_world(save_each_way, 4, str(tmp_path / "m22"), (2, 2), MESH_2X2, True)
    run_local_world(save_each_way, 2, str(tmp_path / "m12"), (1, 2), MESH_1X2, False)
    for mesh in ("m22", "m12"):
        for fmt in ("safetensors", "zarr"):
            conforms(str(tmp_path / mesh / f"save-{fmt}"))
    x = boxes_of(str(tmp_path / "m12" / "save-safetensors"))["model.x"]
    assert sorted(x) == [((0, 0), (2, 4)), ((2, 0), (2, 4))]
    hints = boxes_of(str(tmp_path / "m22" / "dcp-safetensors"))
    conforms(str(tmp_path / "m22" / "dcp-safetensors"))
    conforms(str(tmp_path / "m22" / "dcp-zarr"), hints)
    assert json.load(open(tmp_path / "m22" / "dcp-zarr" / "moeckpt.json"))["format_version"] == 3


@pytest.mark.slow
def test_the_checkpoint_of_an_fsdp2_tp_training_run_conforms(tmp_path):
    from moeckpt.trainer.local_world import run_local_world

    from ..library_workers import fsdp_train

    run_local_world(fsdp_train, 4, 2, 2, str(tmp_path), str(tmp_path / "c"), "save")
    ckpt = conforms(str(tmp_path / "c"))
    placements = {json.dumps(e.sharding["placements"]) for e in ckpt.entries.values() if e.kind == "mesh"}
    assert '["SS(0,2)", "S(0)"]' in placements or '["R", "SS(0,2)", "S(0)"]' in placements, placements


@pytest.mark.slow
def test_four_real_ranks_write_the_zarr_v2_golden_bytes(tmp_path):
    from moeckpt.trainer.local_world import run_local_world

    from ..format_spec_workers import save_golden_v2_state

    run_local_world(save_golden_v2_state, 4, str(tmp_path / "c"), "zarr")
    assert _files(str(tmp_path / "c")) == _files(os.path.join(GOLDEN, "zarr-v2"))


if __name__ == "__main__":  # regenerate: python -m tests.formats.test_format_spec (only for an intended format change)
    import tempfile

    for name, write in GOLDENS.items():
        tmp = os.path.join(tempfile.mkdtemp(), name)
        write(tmp)
        shutil.rmtree(os.path.join(GOLDEN, name), ignore_errors=True)
        shutil.copytree(tmp, os.path.join(GOLDEN, name))
        print(f"wrote tests/golden/{name}", file=sys.stderr)
