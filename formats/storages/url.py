"""Any fsspec URL (``memory://``, ``gs://``, ...): byte-range reads, retried remote operations, index-last commits.

fsspec is imported only when a URL needs it. Remote operations are retried with exponential backoff when the
error is transient (connection reset, timeout, throttling, 5xx); a permanent one (missing bucket, access denied)
becomes a :class:`~moeckpt.formats.errors.StorageError` at once, with one line that names the location and the fix.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any, BinaryIO, TypeVar

from ..commit import CommitStrategy, IndexLast
from ..errors import StorageError
from ..storage import Storage, join, one_line, storage_error, strip_file_scheme
from . import retry as _retry

T = TypeVar("T")

#: remote objects up to this size are uploaded from one joined buffer in a single request; larger ones are
#: streamed through :meth:`FsspecStorage.open_write` (a spooled, bounded multipart upload on S3), so memory stays
#: bounded by concurrent uploads x this.
JOIN_LIMIT_BYTES = 64 * 2**20


class FsspecStorage(Storage):
    """A location given by an fsspec URL; data objects are written in place and the index last."""

    def __init__(self, location: str, *, fs: Any = None, retry: _retry.RetryPolicy | None = None) -> None:
        self.location = strip_file_scheme(location).rstrip("/") or "/"
        self._fs = fs
        self.retry = retry

    # -- construction -----------------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        """The fsspec filesystem of the location (created on first use)."""
        if self._fs is None:
            self._fs = self._make_fs()
        return self._fs

    def _make_fs(self) -> Any:
        import fsspec.core

        fs, _ = fsspec.core.url_to_fs(self.location)
        return fs

    def child(self, relpath: str) -> FsspecStorage:
        return type(self)(join(self.location, relpath), fs=self.fs, retry=self.retry)

    def at(self, location: str) -> FsspecStorage:
        return type(self)(location, fs=self.fs, retry=self.retry)

    @property
    def commit_strategy(self) -> CommitStrategy:
        return IndexLast()

    def _fspath(self, relpath: str = "") -> str:
        # fsspec methods take the protocol-less path for most filesystems; strip_protocol handles each.
        return str(self.fs._strip_protocol(self.path(relpath)))

    def _remote(self, op: Callable[[], T], what: str, relpath: str = "") -> T:
        """Run one remote operation, retrying transient errors with backoff.

        ``FileNotFoundError`` passes through (callers give it a meaning: a missing file), unless
        :meth:`_missing_container` says the whole container is missing; every other final failure becomes a
        one-line :class:`StorageError`.
        """
        policy = self.retry or _retry.DEFAULT_RETRY
        for attempt in range(policy.attempts):
            try:
                return op()
            except (StorageError, KeyboardInterrupt):
                raise
            except FileNotFoundError:
                self._missing_container(what)
                raise
            except Exception as e:  # fsspec backends raise anything; we classify and name it
                if not _retry.is_transient(e) or attempt + 1 == policy.attempts:
                    raise storage_error(e, what, self.path(relpath), attempts=attempt + 1) from e
                time.sleep(policy.delay(attempt))
        raise StorageError(f"{self.path(relpath)}: {what} failed")  # unreachable: attempts >= 1

    def _missing_container(self, what: str) -> None:
        """Raise a one-line :class:`StorageError` if what holds this location (a bucket) does not exist; a missing
        container is bad input, not a missing file. Nothing to check for a plain fsspec URL."""

    # -- reading ---------------------------------------------------------------------------------------
    def exists(self, relpath: str = "") -> bool:
        return self._remote(lambda: bool(self.fs.exists(self._fspath(relpath))), "checking existence", relpath)

    def size(self, relpath: str) -> int:
        try:
            return int(self._remote(lambda: self.fs.size(self._fspath(relpath)), "reading the size", relpath))
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:  # storage backends raise anything; we name the location
            raise storage_error(e, "reading the size", self.path(relpath)) from e

    def read_range(self, relpath: str, start: int, end: int) -> bytearray:
        what = f"reading bytes {start}..{end}"
        try:
            return bytearray(
                self._remote(lambda: self.fs.cat_file(self._fspath(relpath), start=start, end=end), what, relpath)
            )
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:
            raise storage_error(e, what, self.path(relpath)) from e

    def read_bytes(self, relpath: str) -> bytes:
        try:
            return bytes(self._remote(lambda: self.fs.cat_file(self._fspath(relpath)), "reading", relpath))
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:
            raise storage_error(e, "reading", self.path(relpath)) from e

    def read_ranges(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytearray]:
        """Every range is one request (an HTTP range request on an object store), all at once (``cat_ranges``)."""
        if not ranges:
            return []
        paths = [self._fspath(r) for r, _, _ in ranges]
        starts = [s for _, s, _ in ranges]
        ends = [e for _, _, e in ranges]

        def fetch() -> list[bytearray]:
            got = self.fs.cat_ranges(paths, starts, ends, on_error="return")
            for value in got:
                if isinstance(value, BaseException):
                    raise value
            return [bytearray(v) for v in got]

        try:
            return self._remote(fetch, f"reading {len(ranges)} byte ranges", ranges[0][0])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self.location}: an object to read is missing ({one_line(e)})") from e

    def listdir(self, relpath: str = "") -> list[str]:
        try:
            base = self._fspath(relpath).rstrip("/")

            def ls() -> list[str]:
                self.fs.invalidate_cache(base)
                if not self.fs.exists(base):
                    return []
                return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(base, detail=False)})

            names = self._remote(ls, "listing", relpath)
            if not names:
                self._missing_container("listing")
            return names
        except StorageError:
            raise
        except Exception as e:
            raise storage_error(e, "listing", self.path(relpath)) from e

    def list_files(self, relpath: str = "") -> dict[str, int]:
        root = self._fspath(relpath).rstrip("/")

        def find() -> dict:
            self.fs.invalidate_cache(root)
            return dict(self.fs.find(root, detail=True))

        found = self._remote(find, "listing the objects", relpath)
        out = {}
        for path, info in found.items():
            path = path.rstrip("/")
            if path.startswith(root + "/") and info.get("type", "file") != "directory":
                out[path[len(root) + 1 :]] = int(info.get("size") or 0)
        return out

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        """A write-once stream (not seekable); the object appears when the stream is closed. If the body raises,
        what it wrote is removed again (an fsspec file writes itself out when closed, error or not)."""
        failed = False
        try:
            with self.fs.open(self._fspath(relpath), "wb") as f:
                try:
                    yield f
                except BaseException:
                    failed = True
                    raise
        except (StorageError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise storage_error(e, "writing", self.path(relpath)) from e
        finally:
            if failed:
                with suppress(Exception):  # the body's error is the one to report
                    self.fs.rm(self._fspath(relpath))

    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        """An object of up to :data:`JOIN_LIMIT_BYTES` is uploaded from one buffer in one request, retried as a
        whole on transient errors; a larger one goes through :meth:`open_write` rather than joined in memory."""
        del fsync  # an object is durable once its upload completes
        if sum(memoryview(p).nbytes for p in parts) > JOIN_LIMIT_BYTES:
            # A large object is not joined in memory (16 uploads in flight would hold 16 copies): stream it.
            with self.open_write(relpath) as f:
                for p in parts:
                    f.write(p)
            return
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        kwargs = self._pipe_kwargs()
        try:
            self._remote(lambda: self.fs.pipe_file(self._fspath(relpath), data, **kwargs), "writing", relpath)
        except FileNotFoundError as e:
            raise storage_error(e, "writing", self.path(relpath)) from e

    def _pipe_kwargs(self) -> dict[str, Any]:
        """Extra arguments of ``pipe_file`` for one joined object (none for a plain fsspec URL)."""
        return {}

    def remove(self, relpath: str = "") -> None:
        p = self._fspath(relpath)

        def rm() -> None:
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)
            self.fs.invalidate_cache()

        try:
            self._remote(rm, "removing", relpath)
        except StorageError:
            raise
        except Exception as e:
            raise storage_error(e, "removing", self.path(relpath)) from e
