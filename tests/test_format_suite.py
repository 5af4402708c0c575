"""The shared format suite: every behaviour of a checkpoint, over every backend and every storage."""

from __future__ import annotations

import pytest
import torch

from moeckpt.formats import errors
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, committed_steps, resolve, step_dir_name, verify
from moeckpt.formats.index import INDEX_NAME
from moeckpt.formats.storage import Storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import rank_boxes

from .helpers import flip_byte, list_objects, save_toy, tensors_equal, toy_tensors, toy_values

LAYOUTS = [Layout(), Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=2, dp=4)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_round_trip_every_tensor(storage_url, backend, layout):
    index = save_toy(storage_url, layout, backend)
    reader = CheckpointReader(storage_url)
    assert reader.index.layout == layout.to_json()
    assert reader.index.step == 7 and reader.index.train_state["consumed_samples"] == 112
    assert set(reader.index.tensors) == set(index.tensors)
    values = toy_values()
    for name, entry in reader.index.tensors.items():
        assert tensors_equal(reader.read_tensor(name), values(entry)), name
    assert verify(reader) == []


def test_each_rank_reads_exactly_its_boxes(storage_url, backend):
    layout = Layout(tp=2, ep=2, dp=2)
    save_toy(storage_url, layout, backend)
    reader = CheckpointReader(storage_url)
    values = toy_values()
    for rank in range(layout.world):
        for name, entry in reader.index.tensors.items():
            full = values(entry)
            for box in rank_boxes(entry, layout, rank):
                assert tensors_equal(reader.read_box(name, box), full[box.slices()]), (rank, name, box)


def test_partial_box_reads_match(storage_url, backend):
    save_toy(storage_url, Layout(tp=2, ep=2, dp=2), backend)
    reader = CheckpointReader(storage_url)
    entry = reader.index.tensors["exp_avg/moe.experts.gate_up"]
    box = Box((1, 3, 2), (2, 7, 5))  # straddles expert, TP-block and ZeRO boundaries
    assert tensors_equal(reader.read_box(entry.name, box), toy_values()(entry)[box.slices()])


def test_uncommitted_save_is_invisible(storage_url, backend):
    staging = begin_save(storage_url)
    staging.write_bytes("rank-00000.safetensors", b"partial")
    with pytest.raises(errors.NotCommittedError):
        CheckpointReader(storage_url)


def test_refuses_non_empty_destination_unless_overwrite(storage_url, backend):
    save_toy(storage_url, Layout(), backend)
    with pytest.raises(errors.DestinationNotEmptyError, match="--overwrite"):
        save_toy(storage_url, Layout(), backend)
    save_toy(storage_url, Layout(tp=2, dp=2, ep=2), backend, overwrite=True)
    assert CheckpointReader(storage_url).index.layout == {"tp": 2, "ep": 2, "dp": 2}


def test_bit_flip_is_caught_naming_file_and_tensor(storage_url, backend):
    save_toy(storage_url, Layout(tp=2, ep=2, dp=2), backend)
    objects = [o for o in list_objects(storage_url) if not o.endswith(".json")]
    storage = Storage(storage_url)
    target = max(objects, key=storage.size)
    flip_byte(storage_url, target, storage.size(target) - 3)  # last bytes: data, not a header
    problems = verify(CheckpointReader(storage_url))
    assert problems, "a flipped data byte must fail verification"
    assert any("checksum" in p and "'" in p for p in problems), problems


def test_missing_data_file_is_named(storage_url, backend):
    save_toy(storage_url, Layout(tp=2, ep=2, dp=2), backend)
    objects = [o for o in list_objects(storage_url) if o != INDEX_NAME and not o.endswith("zarr.json")]
    Storage(storage_url).remove(objects[0])
    reader = CheckpointReader(storage_url)
    problems = verify(reader)
    assert problems
    with pytest.raises(errors.MoeckptError):
        for name in reader.index.tensors:
            reader.read_tensor(name)


def test_run_directory_resolves_to_newest_committed_step(storage_url, backend):
    run = storage_url
    save_toy(f"{run}/{step_dir_name(5)}", Layout(), backend)
    save_toy(f"{run}/{step_dir_name(10)}", Layout(tp=2, dp=2, ep=2), backend)
    begin_save(f"{run}/{step_dir_name(15)}").write_bytes("rank-00000.safetensors", b"torn")  # died mid-save
    assert resolve(run).location.endswith(step_dir_name(10))
    assert [s for s, _ in committed_steps(run)] == [5, 10]
    assert CheckpointReader(run).index.layout["tp"] == 2


def test_index_lists_files_not_pieces(storage_url, backend):
    """The index grows with tensors and files: going from 1 to 8 ranks must not multiply its size."""
    small = save_toy(storage_url + "-a", Layout(), backend).dumps()
    big = save_toy(storage_url + "-b", Layout(tp=2, ep=2, dp=4), backend).dumps()
    n_files = len(CheckpointReader(storage_url + "-b").index.files)
    assert len(big) - len(small) <= 120 * n_files + 64


def test_all_dtypes(storage_url, backend):
    from moeckpt.formats.dtypes import DTYPE_NAMES, to_torch
    from moeckpt.formats.index import TensorEntry
    from moeckpt.reshard.save import save_full_tensors

    tensors = {
        f"t.{d}": TensorEntry(name=f"t.{d}", shape=(3, 5), dtype=d, role="buffer", param=f"t.{d}") for d in DTYPE_NAMES
    }
    gen = torch.Generator().manual_seed(0)

    def value(e):
        raw = torch.randint(0, 256, (3 * 5 * torch.empty((), dtype=to_torch(e.dtype)).element_size(),), generator=gen,
                            dtype=torch.uint8)
        if e.dtype == "bool":
            raw = raw % 2
        return raw.view(to_torch(e.dtype)).reshape(3, 5)

    want = {n: value(e) for n, e in tensors.items()}
    save_full_tensors(storage_url, tensors=tensors, layout=Layout(dp=2), values=lambda e: want[e.name],
                      model={"arch": "toy"}, backend=backend)
    reader = CheckpointReader(storage_url)
    for n in tensors:
        assert tensors_equal(reader.read_tensor(n), want[n]), n


def test_toy_tensors_have_every_rule_kind():
    rules = {str(sorted(e.sharding.get("tp", {}))) for e in toy_tensors().values()}
    assert {"['dim']", "['blocks', 'dim']", "['dim', 'window']", "[]"} <= rules


def test_tensor_bytes_of_scalars_and_views():
    from moeckpt.formats.pieces import tensor_bytes

    assert bytes(tensor_bytes(torch.tensor(1.5))) == torch.tensor([1.5]).numpy().tobytes()
    assert len(tensor_bytes(torch.tensor(2, dtype=torch.bfloat16))) == 2
    strided = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1:3]
    assert bytes(tensor_bytes(strided)) == strided.contiguous().numpy().tobytes()
