"""The storage contract (``moeckpt.testing.StorageTests``) on local disk, memory:// and S3 (moto)."""

from __future__ import annotations

import itertools
import os

import pytest

from moeckpt.formats.storages import FsspecStorage, LocalStorage, S3Storage, open_storage
from moeckpt.testing import StorageTests

_n = itertools.count()


class TestLocalStorage(StorageTests):
    @pytest.fixture
    def storage_location(self, tmp_path) -> str:
        return str(tmp_path / "store")

    def test_kind(self, storage):
        assert isinstance(storage, LocalStorage) and storage.is_local and storage.fork_safe


class TestMemoryStorage(StorageTests):
    @pytest.fixture
    def storage_location(self) -> str:
        location = f"memory://storage-tests/{os.getpid()}-{next(_n)}"
        yield location
        open_storage(location).remove()

    def test_kind(self, storage):
        assert type(storage) is FsspecStorage and not storage.is_local and not storage.seekable_writes


class TestS3Storage(StorageTests):
    @pytest.fixture
    def storage_location(self, s3_url) -> str:
        return s3_url

    def test_kind(self, storage):
        assert isinstance(storage, S3Storage) and storage.seekable_writes and not storage.fork_safe


def test_factory_picks_the_kind_and_file_urls_are_local(tmp_path):
    assert type(open_storage(f"file://{tmp_path}")) is LocalStorage
    assert open_storage(f"file://{tmp_path}").location == str(tmp_path)
    assert type(open_storage("s3a://bucket/x")) is S3Storage
