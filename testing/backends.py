"""``BackendTests``: the contract every checkpoint backend passes, on any storage.

Subclass it in a pytest module and provide two fixtures::

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def backend_name(self):
            return "mine"              # registered with moeckpt.formats.backend.register_backend

        @pytest.fixture
        def location(self, tmp_path):
            return str(tmp_path / "ckpt")   # a fresh, empty location (a local path or an fsspec URL)

Every test saves toy tensors touching each sharding rule kind through the real save path and reads them back
through the real reader, so a backend that passes works with ``moeckpt reshard``, loads and ``verify``.
"""

from __future__ import annotations

import torch

from moeckpt.formats import errors
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, committed_steps, resolve, step_dir_name, verify
from moeckpt.formats.dtypes import DTYPE_NAMES, to_torch
from moeckpt.formats.index import INDEX_NAME, TensorEntry
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import placements, rank_boxes
from moeckpt.reshard.save import save_full_tensors

from ._pytest import pytest
from .toy import TOY_STEP, save_toy, tensors_equal, toy_values

LAYOUTS = [Layout(), Layout(tp=2, ep=2, dp=2), Layout(tp=1, ep=2, dp=4)]


def list_objects(location: str) -> list[str]:
    """Every stored file or object below ``location`` (relative paths, sorted), on any storage."""
    return sorted(open_storage(location).list_files())


def flip_byte(location: str, relpath: str, offset: int) -> None:
    """Flip one bit pattern of byte ``offset`` of a stored file (a bit rot the checksums must catch)."""
    s = open_storage(location)
    data = bytearray(s.read_bytes(relpath))
    data[offset] ^= 0x40
    s.write_bytes(relpath, bytes(data))


class BackendTests:
    """The shared format suite: every behaviour of a checkpoint, for the backend and storage the fixtures give."""

    @pytest.fixture
    def backend_name(self) -> str:
        raise NotImplementedError("a BackendTests subclass provides the backend_name fixture")

    @pytest.fixture
    def location(self) -> str:
        raise NotImplementedError("a BackendTests subclass provides the location fixture (fresh and empty)")

    # -- round trips -------------------------------------------------------------------------------------
    @pytest.mark.parametrize("layout", LAYOUTS, ids=str)
    def test_round_trip_every_tensor(self, location, backend_name, layout):
        index = save_toy(location, layout, backend_name)
        reader = CheckpointReader(location)
        assert reader.index.layout == layout.to_json()
        assert reader.index.step == TOY_STEP and reader.index.train_state["consumed_samples"] == 112
        assert reader.index.backend == backend_name
        assert set(reader.index.tensors) == set(index.tensors)
        values = toy_values()
        for name, entry in reader.index.tensors.items():
            assert tensors_equal(reader.read_tensor(name), values(entry)), name
        assert verify(reader) == []

    def test_each_rank_reads_exactly_its_boxes(self, location, backend_name):
        layout = Layout(tp=2, ep=2, dp=2)
        save_toy(location, layout, backend_name)
        reader = CheckpointReader(location)
        values = toy_values()
        for rank in range(layout.world):
            for name, entry in reader.index.tensors.items():
                full = values(entry)
                for box in rank_boxes(entry, layout, rank):
                    assert tensors_equal(reader.read_box(name, box), full[box.slices()]), (rank, name, box)

    def test_partial_box_reads_match(self, location, backend_name):
        save_toy(location, Layout(tp=2, ep=2, dp=2), backend_name)
        reader = CheckpointReader(location)
        entry = reader.index.tensors["exp_avg/moe.experts.gate_up"]
        box = Box((1, 3, 2), (2, 7, 5))  # straddles expert, TP-block and ZeRO boundaries
        assert tensors_equal(reader.read_box(entry.name, box), toy_values()(entry)[box.slices()])

    def test_all_dtypes(self, location, backend_name):
        tensors = {
            f"t.{d}": TensorEntry(name=f"t.{d}", shape=(3, 5), dtype=d, role="buffer", param=f"t.{d}")
            for d in DTYPE_NAMES
        }
        gen = torch.Generator().manual_seed(0)

        def value(e):
            size = torch.empty((), dtype=to_torch(e.dtype)).element_size()
            raw = torch.randint(0, 256, (3 * 5 * size,), generator=gen, dtype=torch.uint8)
            if e.dtype == "bool":
                raw = raw % 2
            return raw.view(to_torch(e.dtype)).reshape(3, 5)

        want = {n: value(e) for n, e in tensors.items()}
        save_full_tensors(
            location,
            tensors=tensors,
            layout=Layout(dp=2),
            values=lambda e: want[e.name],
            model={"arch": "toy"},
            backend=backend_name,
        )
        reader = CheckpointReader(location)
        for n in tensors:
            assert tensors_equal(reader.read_tensor(n), want[n]), n

    # -- the read session and the listing the resharder relies on -------------------------------------------
    def test_read_session_rows_equal_read_piece(self, location, backend_name):
        save_toy(location, Layout(tp=2, ep=2, dp=2), backend_name)
        reader = CheckpointReader(location)
        refs = sorted(reader.pieces(), key=lambda r: (r.tensor, r.box))
        session = reader.open_reader()
        try:
            for ref in refs[:: max(1, len(refs) // 48)]:  # every kind of piece, in a bounded number of requests
                n = ref.box.shape[0] if ref.box.ndim else 1
                for lo, hi in {(0, n), (n // 2, n), (0, max(1, n // 3))}:
                    if hi <= lo:
                        continue
                    want = reader.read_piece(ref, (lo, hi) if ref.box.ndim else None)
                    got = session.read_rows(ref, lo, hi)
                    assert tensors_equal(got, want), (ref.tensor, lo, hi)
                    mapped = session.map_rows(ref, lo, hi)
                    assert mapped is None or tensors_equal(mapped, want), (ref.tensor, lo, hi)
                    session.advise(ref, lo, hi)  # a hint: it must not fail
        finally:
            session.close()

    def test_pieces_cover_every_tensor_and_writers_narrow_them(self, location, backend_name):
        layout = Layout(tp=2, ep=2, dp=2)
        save_toy(location, layout, backend_name)
        reader = CheckpointReader(location)
        backend = get_backend(backend_name)
        assert backend.name == backend_name
        refs = reader.pieces()
        for name, entry in reader.index.tensors.items():
            assert sum(r.box.numel for r in refs if r.tensor == name) == entry.numel, name
        if backend.stores_placements:  # then each writer's files hold exactly its placements
            for writer in range(layout.world):
                mine = {(r.tensor, r.box) for r in reader.pieces(writers=[writer])}
                want = {
                    (name, p.box)
                    for name, e in reader.index.tensors.items()
                    for p in placements(e, layout)
                    if p.writer == writer and not p.box.is_empty()
                }
                assert mine == want, writer
        one = sorted(reader.index.tensors)[0]
        assert {r.tensor for r in reader.pieces(tensors=[one])} == {one}

    def test_stored_objects_exist_with_their_sizes(self, location, backend_name):
        save_toy(location, Layout(tp=2, ep=2, dp=2), backend_name)
        reader = CheckpointReader(location)
        objects = reader.backend.stored_objects(reader.storage, reader.index)
        listed = reader.storage.list_files()
        assert objects and INDEX_NAME not in objects
        assert all(listed.get(path) == size for path, size in objects.items()), objects
        assert sum(objects.values()) >= reader.index.nbytes

    def test_top_level_names_are_what_a_save_writes(self, location, backend_name):
        layout = Layout(tp=2, ep=2, dp=2)
        save_toy(location, layout, backend_name)
        reader = CheckpointReader(location)
        said = reader.backend.top_level_names(layout.world, list(reader.index.tensors))
        if said is None:  # allowed: the backend cannot say before it writes
            return
        written = {path.split("/", 1)[0] for path in reader.storage.list_files()} - {INDEX_NAME}
        assert said == written

    # -- commits and damage ------------------------------------------------------------------------------
    def test_uncommitted_save_is_invisible(self, location, backend_name):
        staging = begin_save(location)
        staging.write_bytes("rank-00000.safetensors", b"partial")
        with pytest.raises(errors.NotCommittedError):
            CheckpointReader(location)

    def test_refuses_non_empty_destination_unless_overwrite(self, location, backend_name):
        save_toy(location, Layout(), backend_name)
        with pytest.raises(errors.DestinationNotEmptyError, match="--overwrite"):
            save_toy(location, Layout(), backend_name)
        save_toy(location, Layout(tp=2, dp=2, ep=2), backend_name, overwrite=True)
        assert CheckpointReader(location).index.layout == {"tp": 2, "ep": 2, "dp": 2}

    def test_bit_flip_is_caught_naming_file_and_tensor(self, location, backend_name):
        save_toy(location, Layout(tp=2, ep=2, dp=2), backend_name)
        objects = [o for o in list_objects(location) if not o.endswith(".json")]
        storage = open_storage(location)
        target = max(objects, key=storage.size)
        flip_byte(location, target, storage.size(target) - 3)  # last bytes: data, not a header
        problems = verify(CheckpointReader(location))
        assert problems, "a flipped data byte must fail verification"
        assert any("checksum" in p and "'" in p for p in problems), problems

    def test_missing_data_file_is_named(self, location, backend_name):
        save_toy(location, Layout(tp=2, ep=2, dp=2), backend_name)
        objects = [o for o in list_objects(location) if o != INDEX_NAME and not o.endswith("zarr.json")]
        open_storage(location).remove(objects[0])
        reader = CheckpointReader(location)
        problems = verify(reader)
        assert problems
        with pytest.raises(errors.MoeckptError):
            for name in reader.index.tensors:
                reader.read_tensor(name)

    def test_run_directory_resolves_to_newest_committed_step(self, location, backend_name):
        run = location
        save_toy(f"{run}/{step_dir_name(5)}", Layout(), backend_name)
        save_toy(f"{run}/{step_dir_name(10)}", Layout(tp=2, dp=2, ep=2), backend_name)
        begin_save(f"{run}/{step_dir_name(15)}").write_bytes("rank-00000.safetensors", b"torn")  # died mid-save
        assert resolve(run).location.endswith(step_dir_name(10))
        assert [s for s, _ in committed_steps(run)] == [5, 10]
        assert CheckpointReader(run).index.layout["tp"] == 2

    def test_index_lists_files_not_pieces(self, location, backend_name):
        """The index grows with tensors and files: going from 1 to 8 ranks must not multiply its size."""
        small = save_toy(location + "-a", Layout(), backend_name).dumps()
        big = save_toy(location + "-b", Layout(tp=2, ep=2, dp=4), backend_name).dumps()
        n_files = len(CheckpointReader(location + "-b").index.files)
        assert len(big) - len(small) <= 120 * n_files + 64
