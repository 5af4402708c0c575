"""Local disk: the OS directly, so data is fsynced, directories renamed atomically, files read with ``preadv``."""

from __future__ import annotations

import mmap
import os
import shutil
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO

from ..commit import CommitStrategy, RenameStagingDir
from ..errors import DestinationNotEmptyError, StorageError
from ..storage import Storage, join, storage_error, strip_file_scheme


class LocalStorage(Storage):
    """A local directory (the commit renames a staging directory into place)."""

    is_local = True
    fork_safe = True
    seekable_writes = True

    def __init__(self, location: str, *, fs: Any = None, retry: Any = None) -> None:
        del fs, retry  # no filesystem object and no retries: the OS reports its errors at once
        self.location = os.path.abspath(strip_file_scheme(location).rstrip("/") or "/")

    def child(self, relpath: str) -> LocalStorage:
        return LocalStorage(join(self.location, relpath))

    @property
    def commit_strategy(self) -> CommitStrategy:
        return RenameStagingDir()

    # -- reading ---------------------------------------------------------------------------------------
    def exists(self, relpath: str = "") -> bool:
        return os.path.exists(self.path(relpath))

    def size(self, relpath: str) -> int:
        try:
            return os.path.getsize(self.path(relpath))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(e, "reading the size", self.path(relpath)) from e

    def read_range(self, relpath: str, start: int, end: int) -> bytearray:
        try:
            buf = bytearray(end - start)
            with open(self.path(relpath), "rb", buffering=0) as f:
                f.seek(start)
                got = f.readinto(buf)
            if got != end - start:
                del buf[got:]
            return buf
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(e, f"reading bytes {start}..{end}", self.path(relpath)) from e

    def read_bytes(self, relpath: str) -> bytes:
        try:
            with open(self.path(relpath), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(e, "reading", self.path(relpath)) from e

    def read_ranges(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytearray]:
        out = []
        for relpath, start, end in ranges:
            hi = end if end is not None else self.size(relpath)
            out.append(self.read_range(relpath, start or 0, hi))  # readinto: no copy after the read
        return out

    def listdir(self, relpath: str = "") -> list[str]:
        p = self.path(relpath)
        try:
            return sorted(os.listdir(p)) if os.path.isdir(p) else []
        except OSError as e:
            raise storage_error(e, "listing", p) from e

    def list_files(self, relpath: str = "") -> dict[str, int]:
        root = self.path(relpath)
        out = {}
        for dirpath, _, names in os.walk(root):
            for n in names:
                full = os.path.join(dirpath, n)
                out[os.path.relpath(full, root).replace(os.sep, "/")] = os.path.getsize(full)
        return out

    def open_reader(self) -> LocalFiles:
        return LocalFiles(self)

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        """A file for writing, fsynced before the context exits."""
        target = self.path(relpath)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
        except (StorageError, KeyboardInterrupt):
            raise
        except Exception as e:  # the body's own errors too: named with the file being written
            raise storage_error(e, "writing", target) from e

    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        target = self.path(relpath)
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as f:
                for p in parts:
                    f.write(p)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except Exception as e:  # named with the file being written
            raise storage_error(e, "writing", target) from e

    def makedirs(self, relpath: str = "") -> None:
        """Create the directory (and its parents); a path that cannot be one is a one-line StorageError."""
        try:
            os.makedirs(self.path(relpath), exist_ok=True)
        except OSError as e:
            raise StorageError(
                f"{self.path(relpath)}: cannot create the directory ({e.strerror or e}); choose a location in a "
                "writable directory"
            ) from None

    def refuse_file(self) -> None:
        # Listing a file shows no entries, so a non-empty check alone would let it be replaced.
        if os.path.lexists(self.location) and not os.path.isdir(self.location):
            raise DestinationNotEmptyError(
                f"{self.location}: exists and is a file, not a directory; choose another location or remove the file"
            )

    def remove(self, relpath: str = "") -> None:
        target = self.path(relpath)
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target):
                os.remove(target)
        except OSError as e:
            raise storage_error(e, "removing", target) from e

    def fsync_dir(self, relpath: str = "") -> None:
        fd = os.open(self.path(relpath), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


#: the most buffers one ``preadv`` call takes.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


class LocalFiles:
    """The read session of local disk: files kept open for ``preadv`` (thread-safe on one descriptor), private
    mappings, and kernel read-ahead hints.

    Opening a file for every chunk showed in the profiles of offline reshards, hence the open files; reading with
    ``preadv`` into the caller's (uninitialised) buffer spares the zero-filled ``bytearray`` of
    :meth:`LocalStorage.read_range`, whose memset was a large part of a load (figures: docs/benchmarks/README.md).
    """

    direct = True

    def __init__(self, storage: LocalStorage):
        self.storage = storage
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}

    def fd(self, relpath: str) -> int:
        where = self.storage.path(relpath)
        fd = self._fds.get(where)  # a dict lookup is atomic: only opening takes the lock
        if fd is None:
            fd = os.open(where, os.O_RDONLY)
            with self._lock:
                if where in self._fds:  # another thread opened it meanwhile
                    os.close(fd)
                    fd = self._fds[where]
                else:
                    self._fds[where] = fd
        return fd

    def read_into(self, relpath: str, offset: int, out: memoryview) -> int:
        if not len(out):
            return 0
        try:
            return os.preadv(self.fd(relpath), [out], offset)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise storage_error(e, f"reading bytes {offset}..{offset + len(out)}", self.storage.path(relpath)) from e

    def read_into_parts(self, relpath: str, offset: int, parts: Sequence[memoryview]) -> int:
        fd = self.fd(relpath)
        got = 0
        for i in range(0, len(parts), _IOV_MAX):  # preadv takes at most IOV_MAX buffers a call
            batch = parts[i : i + _IOV_MAX]
            want = sum(len(p) for p in batch)
            try:
                n = os.preadv(fd, batch, offset + got)
            except FileNotFoundError:
                raise
            except OSError as e:
                where = self.storage.path(relpath)
                raise storage_error(e, f"reading bytes {offset + got}..{offset + got + want}", where) from e
            got += n
            if n < want:  # the end of the file
                break
        return got

    def map(self, relpath: str, offset: int, length: int, *, shared: bool = False) -> tuple[mmap.mmap, int]:
        """A private (copy-on-write) mapping: nothing written through it reaches the file; its pages are unmapped
        when the last view of it goes. ``shared``: a read-only shared one (``MAP_SHARED``, ``PROT_READ``)."""
        where = self.storage.path(relpath)
        fd = self.fd(relpath)
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(fd).st_size < offset + length:  # mapping past the end would raise SIGBUS on access
                raise EOFError(f"{where}: file ends before byte {offset + length}")
            access = mmap.ACCESS_READ if shared else mmap.ACCESS_COPY
            return mmap.mmap(fd, offset - base + length, offset=base, access=access), offset - base
        except OSError as e:
            raise storage_error(e, f"mapping bytes {offset}..{offset + length}", where) from e

    def advise(self, relpath: str, offset: int, length: int) -> None:
        if hasattr(os, "posix_fadvise") and length > 0:
            os.posix_fadvise(self.fd(relpath), offset, length, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Close the files (after the reads in flight: a read racing a close could read a descriptor number the
        system has since given to another file)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
