"""A local directory whose writes are slow: a persistent storage that takes longer than several training steps.

Importing this module registers the ``slow://`` scheme (:func:`~moeckpt.formats.storages.register_storage`):
``slow:///abs/path`` is the local directory ``/abs/path``, and every file written there (``write_parts``,
``open_write``) first sleeps :func:`write_delay` seconds (``$MOECKPT_SLOW_WRITE_S``, default 1), as a busy disk
or a far bucket would. Reads are not slowed. Tests use it to show that the memory tier does not wait behind a
persistent save (``tests/trainer/test_memory_tier.py``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO

from moeckpt.formats.commit import CommitStrategy, RenameStagingDir
from moeckpt.formats.storage import Storage, join
from moeckpt.formats.storages import register_storage
from moeckpt.formats.storages.local import LocalStorage

__all__ = ["SCHEME", "SlowStorage", "write_delay"]

SCHEME = "slow"
#: the environment variable giving the seconds each write sleeps.
DELAY_ENV = "MOECKPT_SLOW_WRITE_S"


def write_delay() -> float:
    return float(os.environ.get(DELAY_ENV, "1"))


class SlowStorage(LocalStorage):
    """:class:`~moeckpt.formats.storages.local.LocalStorage` with a sleep before every file written."""

    def __init__(self, location: str, *, fs: Any = None, retry: Any = None) -> None:
        prefix = f"{SCHEME}://"
        super().__init__(location[len(prefix) :] if location.startswith(prefix) else location, fs=fs, retry=retry)

    def child(self, relpath: str) -> SlowStorage:
        return SlowStorage(join(self.location, relpath))

    @property
    def commit_strategy(self) -> CommitStrategy:
        return _SlowStaging()

    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        time.sleep(write_delay())
        with super().open_write(relpath) as f:
            yield f

    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        time.sleep(write_delay())
        super().write_parts(relpath, parts, fsync=fsync)


class _SlowStaging(RenameStagingDir):
    """Local disk's commit (a staging directory renamed into place), the staging directory slow too."""

    def staging(self, final: Storage) -> Storage:
        return SlowStorage(super().staging(final).location)


register_storage(SCHEME, SlowStorage)
