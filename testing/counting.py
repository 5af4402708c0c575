"""A storage that keeps no data: it counts bytes, objects and requests, and reads back zeros.

Importing this module registers the ``count://`` scheme (:func:`~moeckpt.formats.storages.register_storage`), so
``count://NAME/...`` works wherever a location does: a save through the real writers, a resume through the real
readers. Every location under one ``NAME`` shares one :class:`Tally`, found with :func:`tally`.

What is kept: the non-zero bytes written (the headers of the data files and the index; the data itself is
expected to be zeros, which a save of zeroed tensors writes) as segments, so readers parse the headers and verify
checksums of the zeros they read back. :attr:`Tally.rank` names the rank on whose behalf the calls are made (a
one-process simulation of many ranks sets it, :meth:`Tally.as_rank`), and the counts are kept per rank and per
directory. This is how ``benchmarks/sim_1024.py`` measures what 1,024 ranks would ask of a storage, on one core.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from moeckpt.formats.commit import CommitStrategy, IndexLast
from moeckpt.formats.storage import Storage, join
from moeckpt.formats.storages import register_storage

SCHEME = "count"

#: bytes compared at a time when looking for the non-zero parts of a write.
_STRIDE = 1 << 16
_ZEROS = bytes(_STRIDE)


@dataclass
class Counts:
    """Requests and bytes of one rank, or of one directory."""

    read_requests: int = 0
    read_bytes: int = 0
    write_requests: int = 0
    write_bytes: int = 0
    objects: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Object:
    size: int = 0
    #: (offset, bytes) of the non-zero parts written; everything else reads as zeros.
    segments: list[tuple[int, bytes]] = field(default_factory=list)

    def read(self, start: int, end: int) -> bytearray:
        end = min(end, self.size)
        out = bytearray(max(0, end - start))
        for off, data in self.segments:
            lo, hi = max(start, off), min(end, off + len(data))
            if lo < hi:
                out[lo - start : hi - start] = data[lo - off : hi - off]
        return out


class Tally:
    """Everything the storages of one ``count://NAME`` saw: objects (sizes, no data), and counts per rank and per
    directory. Thread-safe (writers and readers run in threads)."""

    def __init__(self) -> None:
        self.objects: dict[str, _Object] = {}
        self.per_rank: dict[int, Counts] = {}
        self.per_dir: dict[str, Counts] = {}
        #: the rank the calls are made for (``-1``: none set).
        self.rank = -1
        self._lock = threading.Lock()

    @contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """Count the calls made inside on ``rank``."""
        before, self.rank = self.rank, rank
        try:
            yield
        finally:
            self.rank = before

    def _count(self, path: str, *, read: int = -1, write: int = -1, new: bool = False) -> None:
        directory = path.rpartition("/")[0]
        with self._lock:
            for c in (self.per_rank.setdefault(self.rank, Counts()), self.per_dir.setdefault(directory, Counts())):
                if read >= 0:
                    c.read_requests += 1
                    c.read_bytes += read
                if write >= 0:
                    c.write_requests += 1
                    c.write_bytes += write
                if new:
                    c.objects += 1

    def _put(self, path: str, obj: _Object) -> None:
        with self._lock:
            self.objects[path] = obj

    def reset_counts(self) -> None:
        """Forget the counts (not the objects): to count a resume apart from the save before it."""
        with self._lock:
            self.per_rank.clear()
            self.per_dir.clear()


_TALLIES: dict[str, Tally] = {}
_TALLIES_LOCK = threading.Lock()


def tally(name: str) -> Tally:
    """The :class:`Tally` of ``count://name`` (made on first use)."""
    with _TALLIES_LOCK:
        return _TALLIES.setdefault(name, Tally())


def forget(name: str) -> None:
    """Drop ``count://name``'s objects and counts."""
    with _TALLIES_LOCK:
        _TALLIES.pop(name, None)


class _CountingFile:
    """A write-once stream: counts what is written, keeps its non-zero parts."""

    def __init__(self) -> None:
        self.obj = _Object()

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        base = self.obj.size
        for lo in range(0, n, _STRIDE):
            part = mv[lo : lo + _STRIDE]
            if part != _ZEROS[: part.nbytes]:
                self.obj.segments.append((base + lo, part.tobytes()))
        self.obj.size += n
        return n

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def flush(self) -> None:
        return None


class CountingStorage(Storage):
    """``count://NAME/prefix``: objects are sizes and their non-zero bytes; reads return zeros elsewhere."""

    is_local = False
    fork_safe = False
    seekable_writes = False

    def __init__(self, location: str, *, fs: Any = None, retry: Any = None) -> None:
        self.location = location.rstrip("/")
        rest = self.location[len(SCHEME) + 3 :]
        name, _, self.prefix = rest.partition("/")
        self.tally = tally(name)

    def _key(self, relpath: str) -> str:
        return join(self.prefix, relpath).strip("/")

    def child(self, relpath: str) -> CountingStorage:
        return CountingStorage(join(self.location, relpath))

    @property
    def commit_strategy(self) -> CommitStrategy:
        return IndexLast()

    # -- reading ---------------------------------------------------------------------------------------
    def _get(self, relpath: str) -> _Object:
        found = self.tally.objects.get(self._key(relpath))
        if found is None:
            raise FileNotFoundError(self.path(relpath))
        return found

    def exists(self, relpath: str = "") -> bool:
        key = self._key(relpath)
        objects = self.tally.objects
        return key in objects or any(k.startswith(key + "/") or not key for k in list(objects))

    def size(self, relpath: str) -> int:
        return self._get(relpath).size

    def read_range(self, relpath: str, start: int, end: int) -> bytearray:
        data = self._get(relpath).read(start, end)
        self.tally._count(self._key(relpath), read=len(data))
        return data

    def read_bytes(self, relpath: str) -> bytes:
        obj = self._get(relpath)
        return bytes(self.read_range(relpath, 0, obj.size))

    def read_ranges(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytearray]:
        out = []
        for relpath, start, end in ranges:
            obj = self._get(relpath)
            out.append(self.read_range(relpath, start or 0, obj.size if end is None else end))
        return out

    def listdir(self, relpath: str = "") -> list[str]:
        key = self._key(relpath)
        head = key + "/" if key else ""
        return sorted({k[len(head) :].split("/")[0] for k in list(self.tally.objects) if k.startswith(head)})

    def list_files(self, relpath: str = "") -> dict[str, int]:
        key = self._key(relpath)
        head = key + "/" if key else ""
        return {k[len(head) :]: o.size for k, o in list(self.tally.objects.items()) if k.startswith(head)}

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        f = _CountingFile()
        yield f  # type: ignore[misc]  # the few file methods writers call
        key = self._key(relpath)
        new = key not in self.tally.objects
        self.tally._put(key, f.obj)
        self.tally._count(key, write=f.obj.size, new=new)

    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        with self.open_write(relpath) as f:
            for p in parts:
                f.write(p)

    def remove(self, relpath: str = "") -> None:
        key = self._key(relpath)
        with self.tally._lock:
            for k in [k for k in self.tally.objects if k == key or not key or k.startswith(key + "/")]:
                del self.tally.objects[k]


register_storage(SCHEME, CountingStorage)
