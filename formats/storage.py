"""The storage seam: the handful of operations the format layer calls, one class per kind of storage.

:class:`Storage` is the protocol (an abstract class: the operations, ``str`` paths throughout, since a
``pathlib.Path`` collapses the ``//`` of ``s3://``). The kinds live in :mod:`moeckpt.formats.storages`:

* :class:`~moeckpt.formats.storages.local.LocalStorage`: a local directory, through the OS, so that data can be
  fsynced, directories renamed atomically, and files read with ``preadv`` or mapped;
* :class:`~moeckpt.formats.storages.url.FsspecStorage`: any fsspec URL (``memory://``, ...), its filesystem made
  when first used, remote operations retried when the error is transient; remote reads are byte ranges;
* :class:`~moeckpt.formats.storages.s3.S3Storage`: ``s3://``, with bounded multipart uploads that an interrupted
  save aborts, and the listing of stale uploads for ``gc``.

:func:`moeckpt.formats.storages.open_storage` picks the class for a location, beside the kinds it picks from: this
module imports none of them, so the abstract seam sits below every kind and no import runs back up to it.

Each kind also names its commit strategy (:mod:`moeckpt.formats.commit`): rename a staging directory on local
disk, write the index last on object stores.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from .errors import NotCommittedError, StorageError

if TYPE_CHECKING:
    from .commit import CommitStrategy


def is_url(location: str) -> bool:
    """Whether ``location`` is a URL (``s3://``, ``memory://``, ...) rather than a local path (``file://`` is local)."""
    return "://" in location and not location.startswith("file://")


def strip_file_scheme(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def join(base: str, *parts: str) -> str:
    """``base/part/...`` with single slashes, for local paths and URLs alike."""
    out = base.rstrip("/")
    for p in parts:
        if p:
            out = f"{out}/{p.strip('/')}"
    return out


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def storage_error(e: BaseException, what: str, where: str, attempts: int = 1) -> StorageError:
    """A one-line :class:`StorageError` for a failed operation, naming the location and, where known, the fix."""
    if isinstance(e, StorageError):
        return e
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on device while {what}; free space or choose another location")
    if isinstance(e, PermissionError):
        return StorageError(
            f"{where}: permission denied while {what} ({one_line(e)}); check the credentials (AWS_* environment) "
            "or file permissions"
        )
    if attempts > 1:
        return StorageError(
            f"{where}: {what} failed after {attempts} tries: {type(e).__name__}: {one_line(e)}; the storage is "
            "unreachable or overloaded, try again later"
        )
    return StorageError(f"{where}: {what} failed: {type(e).__name__}: {one_line(e)}")


class StorageReader(Protocol):
    """A read session over one storage (``Storage.open_reader``): what a backend's hot read loop needs.

    Local disk keeps its files open for ``preadv`` (rather than opening a file per chunk) and maps them; other
    storages copy from byte-range reads and map nothing.
    """

    #: whether :meth:`read_into` lands the bytes in the caller's buffer without an intermediate copy.
    direct: bool

    def read_into(self, relpath: str, offset: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes of ``relpath`` from ``offset`` into ``out``; returns the bytes read (fewer at
        the end of the file)."""
        ...

    def read_into_parts(self, relpath: str, offset: int, parts: Sequence[memoryview]) -> int:
        """Read the bytes of ``relpath`` from ``offset`` into ``parts`` one after another (a vectored read:
        ``len(parts[0])`` bytes into the first, the next ones into the second, ...); returns the bytes read."""
        ...

    def map(self, relpath: str, offset: int, length: int, *, shared: bool = False) -> tuple[Any, int] | None:
        """A private read-only mapping covering bytes ``[offset, offset + length)`` and where ``offset`` lies in
        it, or ``None`` where files cannot be mapped. Raises ``EOFError`` if the file is shorter (touching a
        mapping past the end of a file kills the process). ``shared``: a shared read-only mapping instead, the
        page cache's own pages, which a device driver can lock for DMA without copying them (a private one would
        be copied page by page on the lock)."""
        ...

    def advise(self, relpath: str, offset: int, length: int) -> None:
        """Ask for bytes ``[offset, offset + length)`` to be read ahead (a hint; a no-op where there is none)."""
        ...

    def close(self) -> None:
        """Release what the session holds (open files); call after the reads in flight ended."""
        ...


class Upload(Protocol):
    """A multipart upload left on an object store (see :meth:`Storage.stale_uploads`)."""

    @property
    def relpath(self) -> str:
        """The object being uploaded, relative to the storage it was listed from."""
        ...

    @property
    def age_s(self) -> float:
        """Seconds since the upload last showed activity (its start, or its newest part)."""
        ...


class Storage(ABC):
    """A directory-like location: a local directory or an fsspec URL prefix.

    :func:`moeckpt.formats.storages.open_storage` gives the subclass for a location; :meth:`at` another location
    of the same kind.
    """

    #: files on this machine's filesystem (fsync and rename work; paths are plain OS paths).
    is_local: bool = False
    #: whether objects of this storage survive ``fork`` (no event-loop or I/O threads a child would inherit dead).
    fork_safe: bool = False
    #: whether :meth:`open_write` gives a seekable file (a writer can leave room for a header and seek back).
    seekable_writes: bool = False

    location: str

    def __init__(self, location: str, *, fs: Any = None, retry: Any = None) -> None:
        self.location = location

    # -- naming ----------------------------------------------------------------------------------------
    def path(self, relpath: str = "") -> str:
        """The full path (local) or URL of ``relpath`` below this location."""
        return join(self.location, relpath)

    @abstractmethod
    def child(self, relpath: str) -> Storage:
        """The storage of ``relpath`` below this one (sharing connections)."""

    def at(self, location: str) -> Storage:
        """The storage at another ``location`` of this same kind (a sibling, a parent), as this one was made."""
        return type(self)(location)

    @property
    @abstractmethod
    def commit_strategy(self) -> CommitStrategy:
        """How a checkpoint saved here becomes visible atomically (:mod:`moeckpt.formats.commit`)."""

    # -- reading ---------------------------------------------------------------------------------------
    @abstractmethod
    def exists(self, relpath: str = "") -> bool: ...

    @abstractmethod
    def size(self, relpath: str) -> int:
        """The size of a file; ``FileNotFoundError`` if it is missing."""

    @abstractmethod
    def read_range(self, relpath: str, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of a file (fewer at its end), as a writable buffer (tensors are built on it
        without a copy)."""

    @abstractmethod
    def read_bytes(self, relpath: str) -> bytes: ...

    @abstractmethod
    def read_ranges(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytearray]:
        """Bytes ``[start, end)`` of each ``(relpath, start, end)``; ``None`` bounds mean the start or end of the
        file, so ``(relpath, None, None)`` reads a whole file. Remote ranges are fetched concurrently."""

    @abstractmethod
    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) of the entries directly below ``relpath``, sorted; empty if it does not exist."""

    @abstractmethod
    def list_files(self, relpath: str = "") -> dict[str, int]:
        """``{path relative to relpath: size}`` of every file below ``relpath`` (recursive; no data read)."""

    def open_reader(self) -> StorageReader:
        """A read session for a backend's row reads (see :class:`StorageReader`)."""
        return CopyingReader(self)

    # -- writing ---------------------------------------------------------------------------------------
    @abstractmethod
    def open_write(self, relpath: str) -> AbstractContextManager[BinaryIO]:
        """A binary file for writing; durable (fsynced locally) when the context exits normally. If the body
        raises, nothing is committed to an object store. Seekable where :attr:`seekable_writes` says so."""

    @abstractmethod
    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        """Write one whole file from ``parts`` (fsynced on local disk unless ``fsync=False``)."""

    def write_bytes(self, relpath: str, data: bytes) -> None:
        self.write_parts(relpath, [data])

    def makedirs(self, relpath: str = "") -> None:
        """Create the directory (and its parents) where directories exist; object stores have none."""
        return None

    def refuse_file(self) -> None:
        """Raise :class:`~moeckpt.formats.errors.DestinationNotEmptyError` if this location is a plain file (a
        directory is about to be written here); only local disk has files that are not prefixes."""
        return None

    @abstractmethod
    def remove(self, relpath: str = "") -> None:
        """Remove a file or a whole tree; missing is fine."""

    def fsync_dir(self, relpath: str = "") -> None:
        """Make a directory's entries (new files, renames) durable; a no-op off local disk."""
        return None

    # -- uploads in flight (object stores) ---------------------------------------------------------------
    def cancel_uploads(self) -> list[str]:
        """Abort the uploads in flight below this location and refuse new ones until :meth:`allow_uploads`
        (an interrupted save calls it, so nothing it started is left billed on an object store); the objects
        whose uploads were aborted. A no-op where writes are not uploads."""
        return []

    def allow_uploads(self) -> None:
        """Lift :meth:`cancel_uploads` (a new save to this location begins)."""
        return None

    def stale_uploads(self, older_than_s: float) -> Sequence[Upload]:
        """Multipart uploads below this location started more than ``older_than_s`` seconds ago and never
        completed or aborted (an interrupted or killed save's); empty where writes are not uploads."""
        return []

    def abort_upload(self, upload: Upload) -> None:
        """Abort one upload listed by :meth:`stale_uploads`."""
        raise StorageError(f"{self.location}: this storage has no uploads to abort")


class CopyingReader:
    """The :class:`StorageReader` of a storage that reads byte ranges: each read is copied into the caller's
    buffer, nothing is mapped, hints are ignored."""

    direct = False

    def __init__(self, storage: Storage):
        self.storage = storage

    def read_into(self, relpath: str, offset: int, out: memoryview) -> int:
        data = self.storage.read_range(relpath, offset, offset + len(out))
        out[: len(data)] = data
        return len(data)

    def read_into_parts(self, relpath: str, offset: int, parts: Sequence[memoryview]) -> int:
        data = memoryview(self.storage.read_range(relpath, offset, offset + sum(len(p) for p in parts)))
        at = 0
        for part in parts:
            take = min(len(part), len(data) - at)
            part[:take] = data[at : at + take]
            at += take
        return at

    def map(self, relpath: str, offset: int, length: int, *, shared: bool = False) -> None:
        return None

    def advise(self, relpath: str, offset: int, length: int) -> None:
        return None

    def close(self) -> None:
        return None


def require_exists(storage: Storage, relpath: str, what: str) -> None:
    if not storage.exists(relpath):
        raise NotCommittedError(f"{storage.path(relpath)}: {what} not found")
