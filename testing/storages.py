"""``StorageTests``: the contract every :class:`~moeckpt.formats.storage.Storage` kind passes.

Subclass it in a pytest module and provide one fixture, a fresh and empty location of the storage::

    class TestMyStorage(StorageTests):
        @pytest.fixture
        def storage_location(self, tmp_path):
            return "mystore://bucket/" + tmp_path.name

The tests open the location with :func:`~moeckpt.formats.storages.open_storage`, which must return the new kind
for its URLs.
"""

from __future__ import annotations

from moeckpt.formats import errors
from moeckpt.formats.checkpoint import begin_save, commit, is_committed, quarantine, resolve, staging_storage
from moeckpt.formats.index import INDEX_NAME, Index
from moeckpt.formats.storage import Storage
from moeckpt.formats.storages import open_storage

from ._pytest import pytest


def _payload(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 17 + (i >> 8)) % 251 for i in range(n))


def _index() -> Index:
    return Index(
        backend="safetensors", step=1, layout={"tp": 1, "ep": 1, "dp": 1}, model={"arch": "toy"}, tensors={}, files={}
    )


class StorageTests:
    """The operations the format layer calls, and the commit strategy the storage names."""

    @pytest.fixture
    def storage_location(self) -> str:
        raise NotImplementedError("a StorageTests subclass provides the storage_location fixture (fresh and empty)")

    @pytest.fixture
    def storage(self, storage_location) -> Storage:
        return open_storage(storage_location)

    # -- reading what was written ------------------------------------------------------------------------
    def test_write_then_read_bytes_size_and_exists(self, storage):
        data = _payload(1000)
        assert not storage.exists("a/b.bin")
        storage.write_bytes("a/b.bin", data)
        assert storage.exists("a/b.bin")
        assert storage.size("a/b.bin") == 1000
        assert storage.read_bytes("a/b.bin") == data

    def test_read_range_and_read_ranges(self, storage):
        data = _payload(4096, seed=1)
        storage.write_parts("x.bin", [data[:100], memoryview(data)[100:], b""])
        assert storage.read_range("x.bin", 10, 20) == bytearray(data[10:20])
        assert storage.read_range("x.bin", 4090, 5000) == bytearray(data[4090:])  # fewer at the end
        got = storage.read_ranges([("x.bin", 0, 8), ("x.bin", None, None), ("x.bin", 4000, None), ("x.bin", None, 3)])
        assert got == [bytearray(data[:8]), bytearray(data), bytearray(data[4000:]), bytearray(data[:3])]
        assert all(isinstance(b, bytearray) for b in got)  # writable: tensors are built on them without a copy
        assert storage.read_ranges([]) == []

    def test_missing_files_raise_file_not_found(self, storage):
        with pytest.raises(FileNotFoundError):
            storage.read_bytes("missing.bin")
        with pytest.raises(FileNotFoundError):
            storage.size("missing.bin")
        with pytest.raises(FileNotFoundError):
            storage.read_ranges([("missing.bin", 0, 1)])

    def test_listdir_and_list_files(self, storage):
        assert storage.listdir() == [] and storage.list_files() == {}
        storage.write_bytes("b.bin", b"12")
        storage.write_bytes("a/x.bin", b"1")
        storage.write_bytes("a/y/z.bin", b"123")
        assert storage.listdir() == ["a", "b.bin"]
        assert storage.listdir("a") == ["x.bin", "y"]
        assert storage.listdir("nothing-here") == []
        assert storage.list_files() == {"b.bin": 2, "a/x.bin": 1, "a/y/z.bin": 3}
        assert storage.list_files("a") == {"x.bin": 1, "y/z.bin": 3}

    def test_child_and_path(self, storage):
        child = storage.child("run/step-1")
        assert child.location == storage.path("run/step-1")
        child.write_bytes("f.bin", b"abc")
        assert storage.read_bytes("run/step-1/f.bin") == b"abc"
        assert child.path("f.bin") == storage.path("run/step-1/f.bin")
        assert type(child) is type(storage)

    def test_remove_file_tree_and_missing(self, storage):
        storage.write_bytes("t/a.bin", b"a")
        storage.write_bytes("t/u/b.bin", b"b")
        storage.write_bytes("keep.bin", b"k")
        storage.remove("t/a.bin")
        assert not storage.exists("t/a.bin") and storage.exists("t/u/b.bin")
        storage.remove("t")
        assert not storage.exists("t/u/b.bin")
        storage.remove("never-was")  # missing is fine
        assert storage.list_files() == {"keep.bin": 1}

    # -- writing -----------------------------------------------------------------------------------------
    def test_open_write_streams_and_seeks_where_declared(self, storage):
        with storage.open_write("s.bin") as f:
            if storage.seekable_writes:
                f.write(b"\0" * 4)  # a placeholder header, written last
                f.write(b"payload")
                f.seek(0)
                f.write(b"HEAD")
                f.seek(0, 2)
            else:
                f.write(b"HEAD")
                f.write(b"payload")
        assert storage.read_bytes("s.bin") == b"HEADpayload"

    def test_open_write_that_raises_commits_no_object_store_object(self, storage):
        class Boom(Exception):
            pass

        with pytest.raises((Boom, errors.StorageError)):
            with storage.open_write("boom.bin") as f:
                f.write(b"partial")
                raise Boom()
        if not storage.is_local:  # nothing is left on an object store; local disk keeps the file, uncommitted
            assert not storage.exists("boom.bin")

    def test_large_write_parts_round_trip(self, storage):
        parts = [_payload(1 << 20, seed=i) for i in range(3)]
        storage.write_parts("big.bin", parts)
        assert storage.read_bytes("big.bin") == b"".join(parts)

    # -- the read session --------------------------------------------------------------------------------
    def test_read_session_reads_into_the_callers_buffer(self, storage):
        data = _payload(10_000, seed=3)
        storage.write_bytes("r.bin", data)
        session = storage.open_reader()
        try:
            out = bytearray(100)
            assert session.read_into("r.bin", 5000, memoryview(out)) == 100 and bytes(out) == data[5000:5100]
            assert session.read_into("r.bin", 9950, memoryview(out)) == 50 and bytes(out[:50]) == data[9950:]
            found = session.map("r.bin", 7000, 1000)
            if found is not None:
                mapped, at = found
                assert bytes(memoryview(mapped)[at : at + 1000]) == data[7000:8000]
                with pytest.raises(EOFError):
                    session.map("r.bin", 9000, 2000)
            session.advise("r.bin", 0, 1000)
        finally:
            session.close()

    def test_read_session_reads_into_parts_in_order(self, storage):
        """A vectored read fills the buffers one after another, past the most buffers one system call takes, and
        stops at the end of the file."""
        data = _payload(10_000, seed=4)
        storage.write_bytes("v.bin", data)
        session = storage.open_reader()
        try:
            sizes = [1, 0, 7, 3] * 700  # 2,800 buffers, 7,700 bytes
            parts = [memoryview(bytearray(n)) for n in sizes]
            assert session.read_into_parts("v.bin", 1000, parts) == sum(sizes)
            assert b"".join(bytes(p) for p in parts) == data[1000 : 1000 + sum(sizes)]
            tail = [memoryview(bytearray(30)), memoryview(bytearray(30))]
            assert session.read_into_parts("v.bin", 9950, tail) == 50
            assert bytes(tail[0]) + bytes(tail[1][:20]) == data[9950:]
        finally:
            session.close()

    # -- commits -----------------------------------------------------------------------------------------
    def test_commit_strategy_publishes_the_index_last(self, storage):
        location = storage.path("ckpt")
        staging = begin_save(location)
        assert staging.location == staging_storage(location).location
        staging.write_bytes("data.bin", b"data")
        assert not is_committed(open_storage(location))
        with pytest.raises(errors.NotCommittedError):
            resolve(location)
        commit(location, _index())
        final = open_storage(location)
        assert is_committed(final) and final.read_bytes("data.bin") == b"data"
        assert sorted(final.listdir()) == ["data.bin", INDEX_NAME]
        assert storage.listdir() == ["ckpt"]  # no staging leftover beside it

    def test_overwrite_replaces_and_quarantine_uncommits(self, storage):
        location = storage.path("ckpt")
        begin_save(location).write_bytes("old.bin", b"old")
        commit(location, _index())
        with pytest.raises(errors.DestinationNotEmptyError):
            begin_save(location)
        begin_save(location, overwrite=True).write_bytes("new.bin", b"new")
        commit(location, _index())
        assert sorted(open_storage(location).listdir()) == [INDEX_NAME, "new.bin"]
        moved = quarantine(location)
        assert not is_committed(open_storage(location))
        assert moved  # where the damaged checkpoint went (itself, uncommitted, on an object store)

    def test_uploads_cancel_and_allow(self, storage):
        assert isinstance(storage.cancel_uploads(), list)
        storage.allow_uploads()
        storage.write_bytes("after.bin", b"ok")  # writes work again once a new save begins
        assert storage.read_bytes("after.bin") == b"ok"
        assert storage.stale_uploads(0.0) == []
