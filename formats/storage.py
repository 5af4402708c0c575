"""The storage seam: the handful of operations the format layer needs, over local disk or any fsspec URL.

Paths are ``str`` throughout (a ``pathlib.Path`` collapses the ``//`` of ``s3://``). Local paths use the OS
directly so that data can be fsynced and directories renamed atomically; everything else goes through fsspec,
imported only when a URL needs it. Remote reads are byte ranges, never whole-file downloads.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from .errors import NotCommittedError, StorageError


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _strip_file_scheme(location: str) -> str:
    return location[len("file://") :] if location.startswith("file://") else location


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        if p:
            out = f"{out}/{p.strip('/')}"
    return out


def _storage_error(e: BaseException, what: str, where: str) -> StorageError:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on device while {what}; free space or choose another location")
    if isinstance(e, PermissionError):
        return StorageError(f"{where}: permission denied while {what}; check credentials or file permissions")
    return StorageError(f"{where}: {what} failed: {type(e).__name__}: {e}")


class Storage:
    """A directory-like location: a local directory or an fsspec URL prefix."""

    def __init__(self, location: str, fs=None):
        self.location = _strip_file_scheme(location).rstrip("/") or "/"
        self.is_local = not is_url(self.location)
        self._fs = fs
        if self.is_local:
            self.location = os.path.abspath(self.location)

    # -- construction -----------------------------------------------------------------------------------
    @property
    def fs(self):
        """The fsspec filesystem of a URL location (created on first use)."""
        if self._fs is None:
            import fsspec.core

            self._fs, _ = fsspec.core.url_to_fs(self.location, **_storage_options(self.location))
        return self._fs

    def child(self, relpath: str) -> "Storage":
        return Storage(join(self.location, relpath), fs=None if self.is_local else self.fs)

    def path(self, relpath: str = "") -> str:
        """The full path (local) or URL of ``relpath`` below this location."""
        return join(self.location, relpath)

    def _fspath(self, relpath: str = "") -> str:
        # fsspec methods take the protocol-less path for most filesystems; strip_protocol handles each.
        return self.fs._strip_protocol(self.path(relpath))

    # -- reading ---------------------------------------------------------------------------------------
    def exists(self, relpath: str = "") -> bool:
        if self.is_local:
            return os.path.exists(self.path(relpath))
        return self.fs.exists(self._fspath(relpath))

    def size(self, relpath: str) -> int:
        try:
            if self.is_local:
                return os.path.getsize(self.path(relpath))
            return int(self.fs.size(self._fspath(relpath)))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - storage backends raise anything; we name the location
            raise _storage_error(e, "reading the size", self.path(relpath)) from e

    def read_range(self, relpath: str, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)`` of a file, as a writable buffer (tensors are built on it without a copy)."""
        try:
            if self.is_local:
                buf = bytearray(end - start)
                with open(self.path(relpath), "rb", buffering=0) as f:
                    f.seek(start)
                    got = f.readinto(buf)
                if got != end - start:
                    del buf[got:]
                return buf
            return bytearray(self.fs.cat_file(self._fspath(relpath), start=start, end=end))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, f"reading bytes {start}..{end}", self.path(relpath)) from e

    def read_bytes(self, relpath: str) -> bytes:
        try:
            if self.is_local:
                with open(self.path(relpath), "rb") as f:
                    return f.read()
            return self.fs.cat_file(self._fspath(relpath))
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "reading", self.path(relpath)) from e

    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) of the entries directly below ``relpath``; empty if it does not exist."""
        try:
            if self.is_local:
                p = self.path(relpath)
                return sorted(os.listdir(p)) if os.path.isdir(p) else []
            base = self._fspath(relpath).rstrip("/")
            if not self.fs.exists(base):
                return []
            self.fs.invalidate_cache(base)
            return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(base, detail=False)})
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "listing", self.path(relpath)) from e

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        """A binary file for writing; on local disk its data is fsynced before the context exits."""
        target = self.path(relpath)
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
            else:
                with self.fs.open(self._fspath(relpath), "wb") as f:
                    yield f
        except (StorageError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "writing", target) from e

    def write_bytes(self, relpath: str, data: bytes) -> None:
        with self.open_write(relpath) as f:
            f.write(data)

    def makedirs(self, relpath: str = "") -> None:
        if self.is_local:
            os.makedirs(self.path(relpath), exist_ok=True)
        # object stores have no directories

    def remove(self, relpath: str = "") -> None:
        """Remove a file or a whole tree; missing is fine."""
        target = self.path(relpath)
        try:
            if self.is_local:
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                elif os.path.lexists(target):
                    os.remove(target)
                return
            p = self._fspath(relpath)
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)
            self.fs.invalidate_cache()
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "removing", target) from e

    def fsync_dir(self, relpath: str = "") -> None:
        """Make a directory's entries (new files, renames) durable; a no-op off local disk."""
        if not self.is_local:
            return
        fd = os.open(self.path(relpath), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _storage_options(location: str) -> dict:
    """fsspec options from the standard environment (``AWS_ENDPOINT_URL_S3`` is not read by every s3fs)."""
    if location.startswith(("s3://", "s3a://")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            return {"client_kwargs": {"endpoint_url": endpoint}}
    return {}


def require_exists(storage: Storage, relpath: str, what: str) -> None:
    if not storage.exists(relpath):
        raise NotCommittedError(f"{storage.path(relpath)}: {what} not found")
