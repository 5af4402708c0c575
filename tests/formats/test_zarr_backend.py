"""The zarr backend: plain-zarr readability, the writer-aligned grid, and that writers never share an object."""

from __future__ import annotations

import json
import threading

import fsspec
import numpy as np
import pytest
import torch
import zarr
from fsspec.implementations.memory import MemoryFileSystem

from moeckpt.formats import errors
from moeckpt.formats.backends import zarr as zb
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, commit, verify
from moeckpt.formats.dtypes import DTYPE_NAMES, to_torch
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import placements
from moeckpt.reshard.save import save_full_tensors

from ..helpers import list_objects, save_toy, tensors_equal, toy_tensors, toy_values


def random_value(entry: TensorEntry, seed: int = 0) -> torch.Tensor:
    """Random bits of the right dtype (NaNs and all), so the round trip is checked bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=to_torch(entry.dtype)).element_size()
    raw = torch.randint(0, 256, (entry.numel * size,), generator=gen, dtype=torch.uint8)
    if entry.dtype == "bool":
        raw = raw % 2
    return raw.view(to_torch(entry.dtype)).reshape(entry.shape)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that also takes 0-d tensors (the shared helper views them as bytes, which torch refuses)."""
    return a.shape == b.shape and tensors_equal(a.reshape(-1), b.reshape(-1))


def plain_zarr_tensor(location: str, name: str) -> torch.Tensor:
    """Read one tensor with zarr alone (no moeckpt code), the way docs/zarr.md tells users to."""
    arr = zarr.open_array(store=location, path=name, mode="r")
    data = arr[...]
    real = arr.attrs["moeckpt"]["dtype"]
    t = torch.from_numpy(np.array(data, copy=True))  # np.ascontiguousarray would make a 0-d array 1-d
    return t.view(getattr(torch, real)) if real != "bool" else t


def test_every_dtype_round_trips_and_plain_zarr_reads_it(tmp_path):
    tensors = {
        f"t/{d}": TensorEntry(name=f"t/{d}", shape=(6, 5), dtype=d, role="buffer", param=f"t/{d}") for d in DTYPE_NAMES
    }
    tensors["scalar"] = TensorEntry(name="scalar", shape=(), dtype="float32", role="buffer", param="scalar")
    want = {n: random_value(e, seed=i) for i, (n, e) in enumerate(tensors.items())}
    loc = str(tmp_path / "ckpt")
    save_full_tensors(
        loc, tensors=tensors, layout=Layout(dp=2), values=lambda e: want[e.name], model={"arch": "toy"}, backend="zarr"
    )
    reader = CheckpointReader(loc)
    assert verify(reader) == []
    for name in tensors:
        assert same(reader.read_tensor(name), want[name]), name
        assert same(plain_zarr_tensor(loc, name), want[name]), name
    # bf16 and fp8 are stored as same-width unsigned ints, the real dtype in the attributes
    arr = zarr.open_array(store=loc, path="t/bfloat16", mode="r")
    assert arr.dtype == np.uint16 and arr.attrs["moeckpt"]["dtype"] == "bfloat16"
    assert zarr.open_array(store=loc, path="t/float8_e4m3fn", mode="r").dtype == np.uint8
    # the tensors form a zarr hierarchy that zarr can walk
    group = zarr.open_group(store=loc, mode="r")
    assert sorted(group["t"].array_keys()) == sorted(d for d in DTYPE_NAMES)


def test_plain_zarr_reads_sharded_arrays_partially(tmp_path, monkeypatch):
    monkeypatch.setattr(zb, "INNER_CHUNK_BYTES", 256)  # force the sharding codec on a small tensor
    entry = TensorEntry(name="exp_avg/w", shape=(24, 16), dtype="bfloat16", role="exp_avg", param="w")
    value = random_value(entry)
    loc = str(tmp_path / "ckpt")
    save_full_tensors(
        loc,
        tensors={"exp_avg/w": entry},
        layout=Layout(dp=2),
        values=lambda e: value,
        model={"arch": "toy"},
        backend="zarr",
    )
    arr = zarr.open_array(store=loc, path="exp_avg/w", mode="r")
    assert arr.shards == (12, 16) and arr.chunks == (6, 16)  # one shard per writer; 8 rows fit 256 B, 6 divide 12
    assert tensors_equal(torch.from_numpy(arr[5:19]).view(torch.bfloat16), value[5:19])
    reader = CheckpointReader(loc)
    refs = reader.pieces()
    assert [r.box for r in refs] == [Box((0, 0), (12, 16)), Box((12, 0), (12, 16))]
    assert tensors_equal(reader.read_piece(refs[1], (3, 11)), value[15:23])
    assert tensors_equal(reader.read_box("exp_avg/w", Box((5, 2), (14, 9))), value[5:19, 2:11])


def test_grid_is_gcd_of_inner_piece_boundaries():
    boxes = [Box((0, 0), (4, 8)), Box((4, 0), (4, 8)), Box((8, 0), (2, 8))]  # ZeRO ceil(10/3) = 4: 4, 4, 2 rows
    assert zb.grid_shape((10, 8), boxes) == (4, 8)  # the last chunk overhangs the array: one cell per piece
    plan = zb.plan_array(TensorEntry(name="x", shape=(10, 8), dtype="float32", role="master", param="x"), boxes)
    assert list(plan.cells()) == boxes
    assert plan.stored_shape(boxes[2]) == (4, 8) and plan.stored_shape(boxes[0]) is None
    with pytest.raises(errors.CheckpointIndexError, match="not aligned"):
        list(plan.cells(Box((3, 0), (2, 8))))
    # boundaries that share no factor still give a grid every piece is a union of
    odd = [Box((0,), (3,)), Box((3,), (5,)), Box((8,), (2,))]
    assert zb.grid_shape((10,), odd) == (1,)
    overlapping = [Box((0, 0), (6, 8)), Box((4, 0), (6, 8))]
    with pytest.raises(errors.CheckpointIndexError, match="exactly once"):
        zb.plan_array(TensorEntry(name="x", shape=(10, 8), dtype="float32", role="master", param="x"), overlapping)


def test_inner_chunks_split_leading_dims_first():
    assert zb.inner_chunk_shape((4, 4), 4, limit=1024) is None
    assert zb.inner_chunk_shape((64, 16), 4, limit=1024) == (16, 16)
    assert zb.inner_chunk_shape((2, 64, 16), 4, limit=1024) == (1, 16, 16)
    assert zb.inner_chunk_shape((7, 16), 4, limit=200) == (1, 16)  # a prime row count: one row per chunk


def test_array_metadata_golden():
    """The exact zarr.json of a sharded bf16 array: a format change must be deliberate."""
    entry = TensorEntry(
        name="exp_avg/layers.0.w", shape=(8, 4096), dtype="bfloat16", role="exp_avg", param="layers.0.w"
    )
    plan = zb.plan_array(entry, [Box((0, 0), (4, 4096)), Box((4, 0), (4, 4096))])
    assert plan.meta_path == "exp_avg/layers.0.w/zarr.json"
    assert plan.key(Box((4, 0), (4, 4096))) == "exp_avg/layers.0.w/c/1/0"
    golden = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [8, 4096],
        "data_type": "uint16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4096]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "attributes": {"moeckpt": {"dtype": "bfloat16", "format_version": 1}},
    }
    assert json.loads(plan.metadata_bytes()) == golden
    big = zb.plan_array(
        entry.__class__(**{**entry.__dict__, "shape": (4096, 4096), "dtype": "float32"}), [Box((0, 0), (4096, 4096))]
    )
    codec = json.loads(big.metadata_bytes())["codecs"][0]
    assert codec == {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [256, 4096],
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "start",
        },
    }
    # zarr itself accepts both documents
    from zarr.core.metadata.v3 import ArrayV3Metadata

    for p in (plan, big):
        assert ArrayV3Metadata.from_dict(json.loads(p.metadata_bytes())).shape == p.shape


class RecordingFS(MemoryFileSystem):
    """An in-memory fsspec filesystem that records every object written and read, per recording label."""

    protocol = ("recmem",)
    root_marker = "/"
    _lock = threading.Lock()
    label = "setup"
    writes: list[tuple[str, str]] = []
    reads: list[tuple[str, str, int]] = []

    def pipe_file(self, path, value, **kwargs):
        with self._lock:
            RecordingFS.writes.append((RecordingFS.label, self._strip_protocol(path)))
        return super().pipe_file(path, value, **kwargs)

    def cat_file(self, path, start=None, end=None, **kwargs):
        out = super().cat_file(path, start=start, end=end, **kwargs)
        with self._lock:
            RecordingFS.reads.append((RecordingFS.label, self._strip_protocol(path), len(out)))
        return out


fsspec.register_implementation("recmem", RecordingFS, clobber=True)


@pytest.mark.parametrize("layout", [Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=1, dp=3)], ids=str)
def test_two_writers_never_write_the_same_object(layout):
    """Every object is written by exactly one writer, exactly once, and no writer reads a chunk object."""
    RecordingFS.writes.clear()
    RecordingFS.reads.clear()
    tensors = toy_tensors()
    values = toy_values()
    by_writer: dict[int, list[Piece]] = {r: [] for r in range(layout.world)}
    for entry in tensors.values():
        full = values(entry)
        for p in placements(entry, layout):
            by_writer[p.writer].append(Piece(entry.name, p.box, full[p.box.slices()]))
    loc = f"recmem://zarr-writers/{layout.dp}-{layout.tp}/ckpt"
    storage = begin_save(loc)
    backend = zb.ZarrBackend()
    RecordingFS.label = "prepare"
    backend.prepare(storage, tensors, {n: [p.box for p in placements(e, layout)] for n, e in tensors.items()})
    for w in sorted(by_writer):
        # a fresh backend per writer, as in a multi-process save: it learns the grid from the stored zarr.json
        RecordingFS.label = f"writer-{w}"
        assert zb.ZarrBackend().write(storage, w, by_writer[w], tensors) == []
    RecordingFS.label = "finish"
    files = backend.finish(storage, [], tensors)
    commit(
        loc,
        Index(
            backend="zarr",
            step=1,
            layout=layout.to_json(),
            model={"arch": "toy"},
            tensors=tensors,
            files={f.path: f for f in files},
        ),
    )

    documents = ("zarr.json", "moeckpt.json")
    chunk_writes = [(who, path) for who, path in RecordingFS.writes if not path.endswith(documents)]
    keys = [path for _, path in chunk_writes]
    assert len(keys) == len(set(keys)), "an object was written twice"
    writers_of = {}
    for who, path in chunk_writes:
        writers_of.setdefault(path, set()).add(who)
    assert all(len(w) == 1 and next(iter(w)).startswith("writer-") for w in writers_of.values())
    per_writer = {}
    for who, path in chunk_writes:
        per_writer.setdefault(who, set()).add(path)
    assert len(per_writer) == layout.world  # every writer wrote something
    # writers read array documents only (to learn the grid), never a chunk object: no read-modify-write
    assert not [r for r in RecordingFS.reads if r[0].startswith("writer-") and not r[1].endswith(documents)]
    stored = {o for o in list_objects(loc) if "/c" in o}
    assert stored == {k.split("/ckpt/", 1)[1] for k in keys}
    reader = CheckpointReader(loc)
    assert verify(reader) == []
    for name, entry in tensors.items():
        assert tensors_equal(reader.read_tensor(name), values(entry)), name


def test_partial_read_fetches_only_the_needed_inner_chunks(monkeypatch):
    monkeypatch.setattr(zb, "INNER_CHUNK_BYTES", 4096)
    entry = TensorEntry(name="master/w", shape=(64, 256), dtype="float32", role="master", param="w")  # 64 KiB
    value = random_value(entry)
    loc = "recmem://zarr-partial/ckpt"
    save_full_tensors(
        loc, tensors={entry.name: entry}, layout=Layout(), values=lambda e: value, model={"arch": "toy"}, backend="zarr"
    )
    reader = CheckpointReader(loc)
    (ref,) = reader.pieces()
    assert ref.chunks == (4, 256)  # 4 rows x 1 KiB = 4 KiB inner chunks
    RecordingFS.reads.clear()
    RecordingFS.label = "read"
    got = reader.read_piece(ref, (10, 20))  # rows 10..19 live in inner chunks 2, 3, 4
    assert tensors_equal(got, value[10:20])
    data_read = sum(n for who, _, n in RecordingFS.reads if who == "read")
    assert data_read == 16 * 16 + 4 + 3 * (4096 + 4)  # the shard index plus three inner chunks


def test_corrupt_chunk_is_caught_by_moeckpt_and_by_zarr(tmp_path):
    loc = str(tmp_path / "ckpt")
    save_toy(loc, Layout(tp=2, ep=2, dp=2), "zarr")
    target = "exp_avg/moe.experts.gate_up/c/0/0/0"
    raw = bytearray(open_storage(loc).read_bytes(target))
    raw[5] ^= 0x10
    open_storage(loc).write_bytes(target, bytes(raw))
    problems = verify(CheckpointReader(loc))
    assert len(problems) == 1 and "checksum mismatch" in problems[0] and "'exp_avg/moe.experts.gate_up'" in problems[0]
    with pytest.raises(ValueError, match="checksum"):
        zarr.open_array(store=loc, path="exp_avg/moe.experts.gate_up", mode="r")[...]


def test_changed_array_document_is_refused(tmp_path):
    loc = str(tmp_path / "ckpt")
    save_toy(loc, Layout(), "zarr")
    path = "embed.weight/zarr.json"
    doc = json.loads(open_storage(loc).read_bytes(path))
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1]
    open_storage(loc).write_bytes(path, json.dumps(doc, indent=2).encode())
    problems = verify(CheckpointReader(loc))
    assert any("embed.weight/zarr.json" in p and "differs from the index" in p for p in problems), problems


def test_names_that_cannot_be_zarr_paths_are_refused(tmp_path):
    def entry(n):
        return TensorEntry(name=n, shape=(2,), dtype="float32", role="buffer", param=n)

    for names, match in [
        (["a", "a/b"], "both an array and a group"),
        (["x/__meta"], "'__'"),
        (["moeckpt.json"], "moeckpt.json"),
    ]:
        with pytest.raises(errors.CheckpointIndexError, match=match):
            save_full_tensors(
                str(tmp_path / "c"),
                tensors={n: entry(n) for n in names},
                layout=Layout(),
                values=lambda e: torch.zeros(2),
                model={"arch": "toy"},
                backend="zarr",
                overwrite=True,
            )


def test_multi_process_save_path_reads_the_grid_from_storage(tmp_path):
    """prepare on one backend, write on others, finish on a third: the trainer's distributed save."""
    layout = Layout(tp=2, ep=2, dp=2)
    tensors, values = toy_tensors(), toy_values()
    loc = str(tmp_path / "ckpt")
    storage = begin_save(loc)
    zb.ZarrBackend().prepare(storage, tensors, {n: [p.box for p in placements(e, layout)] for n, e in tensors.items()})
    for w in range(layout.world):
        pieces = [
            Piece(n, p.box, values(e)[p.box.slices()])
            for n, e in tensors.items()
            for p in placements(e, layout)
            if p.writer == w
        ]
        zb.ZarrBackend().write(storage, w, pieces, tensors)
    files = zb.ZarrBackend().finish(storage, [], tensors)
    commit(
        loc,
        Index(
            backend="zarr",
            step=3,
            layout=layout.to_json(),
            model={"arch": "toy"},
            tensors=tensors,
            files={f.path: f for f in files},
        ),
    )
    reader = CheckpointReader(loc)
    assert verify(reader) == []
    assert len(reader.index.files) == len(tensors) + len(zb.group_paths(tensors))


def test_uneven_zero_split_is_one_object_per_piece_and_zarr_reads_the_edge(tmp_path, monkeypatch):
    """dp=3 over 10 rows: parts of 4, 4, 2 rows; the last is stored padded, as zarr stores edge chunks."""
    entry = TensorEntry(name="exp_avg/w", shape=(10, 6), dtype="bfloat16", role="exp_avg", param="w")
    value = random_value(entry)
    for limit, sharded in ((1 << 20, False), (16, True)):
        monkeypatch.setattr(zb, "INNER_CHUNK_BYTES", limit)
        loc = str(tmp_path / f"ckpt-{limit}")
        save_full_tensors(
            loc,
            tensors={entry.name: entry},
            layout=Layout(dp=3),
            values=lambda e: value,
            model={"arch": "toy"},
            backend="zarr",
        )
        reader = CheckpointReader(loc)
        refs = reader.pieces()
        assert [r.box.shape for r in refs] == [(4, 6), (4, 6), (2, 6)] and (refs[0].chunks is not None) == sharded
        assert verify(reader) == []
        assert tensors_equal(reader.read_tensor(entry.name), value)
        assert tensors_equal(reader.read_piece(refs[2], (1, 2)), value[9:10])
        assert tensors_equal(reader.read_box(entry.name, Box((3, 1), (7, 4))), value[3:10, 1:5])
        assert tensors_equal(plain_zarr_tensor(loc, entry.name), value)


@pytest.mark.parametrize("seed", range(6))
def test_random_partitions_round_trip_through_moeckpt_and_zarr(tmp_path, monkeypatch, seed):
    """Random rectilinear partitions (edge cells in any dim, sharded or not) read back exactly, both ways."""
    import random

    rng = random.Random(seed)
    monkeypatch.setattr(zb, "INNER_CHUNK_BYTES", rng.choice([8, 64, 1 << 20]))

    def cuts(n: int) -> list[int]:
        inner = sorted(rng.sample(range(1, n), k=rng.randint(0, min(3, n - 1))))
        return [0, *inner, n]

    shape = (rng.randint(1, 13), rng.randint(1, 9))
    entry = TensorEntry(
        name="t/x", shape=shape, dtype=rng.choice(["float32", "bfloat16", "int8"]), role="buffer", param="t/x"
    )
    value = random_value(entry, seed)
    r, c = cuts(shape[0]), cuts(shape[1])
    boxes = [
        Box((r[i], c[j]), (r[i + 1] - r[i], c[j + 1] - c[j])) for i in range(len(r) - 1) for j in range(len(c) - 1)
    ]
    by_writer = {w: [Piece("t/x", b, value[b.slices()]) for k, b in enumerate(boxes) if k % 3 == w] for w in range(3)}
    loc = str(tmp_path / "ckpt")
    from moeckpt.formats.checkpoint import save_pieces

    save_pieces(
        loc,
        Index(backend="zarr", step=0, layout={"dp": 3}, model={"arch": "toy"}, tensors={"t/x": entry}, files={}),
        by_writer,
    )
    reader = CheckpointReader(loc)
    assert verify(reader) == []
    assert tensors_equal(reader.read_tensor("t/x"), value)
    box = Box((rng.randrange(shape[0]), rng.randrange(shape[1])), (1, 1))
    box = Box(box.offsets, (rng.randint(1, shape[0] - box.offsets[0]), rng.randint(1, shape[1] - box.offsets[1])))
    assert tensors_equal(reader.read_box("t/x", box), value[box.slices()])
    assert tensors_equal(plain_zarr_tensor(loc, "t/x"), value)
