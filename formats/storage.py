"""The storage seam: the handful of operations the format layer needs, over local disk or any fsspec URL.

Paths are ``str`` throughout (a ``pathlib.Path`` collapses the ``//`` of ``s3://``). Local paths use the OS
directly so that data can be fsynced and directories renamed atomically; everything else goes through fsspec,
imported only when a URL needs it. Remote reads are byte ranges, never whole-file downloads.

Remote operations are retried with exponential backoff when the error is transient (connection reset, timeout,
throttling, 5xx); a permanent one (missing bucket, access denied) becomes a :class:`StorageError` at once, with
one line that names the location and the fix.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Sequence, TypeVar

from .errors import DestinationNotEmptyError, NotCommittedError, StorageError


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


T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How remote operations are retried when the error is transient."""

    #: tries in all, the first included.
    attempts: int = 5
    #: the delay before the second try; it doubles on each further try (with jitter), up to ``max_delay_s``.
    base_delay_s: float = 0.25
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("RetryPolicy needs 0 <= base_delay_s <= max_delay_s")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (0-based)."""
        d = min(self.max_delay_s, self.base_delay_s * (2**attempt))
        return d * (0.5 + random.random() / 2)  # jitter: many ranks retrying must not hit the store in lockstep


#: remote objects up to this size are uploaded from one joined buffer in a single PUT; larger ones are spooled
#: through a temporary file (see :meth:`Storage.open_write`), so memory stays bounded by concurrent uploads x this.
JOIN_LIMIT_BYTES = 64 * 2**20

#: the part size of S3 multipart uploads of spooled files. s3fs's default is 50 MiB parts, 10 in flight per
#: upload (``S3FileSystem.max_concurrency``): 500 MiB of parts in memory per upload and per writer thread, and a
#: file under 100 MiB read whole into memory for one PUT. 16 MiB keeps well above S3's 5 MiB minimum part (few
#: requests) while a file under 2 parts (32 MiB) is still one PUT; objects over 10,000 parts x 16 MiB (156 GiB)
#: get larger parts (:func:`s3_part_bytes`).
S3_PART_BYTES = 16 * 2**20

#: the parts of one upload in flight at once: memory per upload is S3_PART_BYTES x this (64 MiB; about 150 MB
#: RSS with botocore's copies), while four parts' round trips still overlap; the writers upload in parallel too.
S3_UPLOAD_CONCURRENCY = 4

#: S3 allows at most this many parts in one multipart upload.
_S3_MAX_PARTS = 10_000


def s3_part_bytes(size: int) -> int:
    """The multipart part size for an S3 object of ``size`` bytes: :data:`S3_PART_BYTES`, larger if needed."""
    return max(S3_PART_BYTES, -(-size // _S3_MAX_PARTS))


#: the policy every :class:`Storage` uses unless given another (tests shorten it).
DEFAULT_RETRY = RetryPolicy()

#: S3 error codes that a later try may not see (throttling, server-side trouble).
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
     "ServiceUnavailable", "500", "502", "503", "504"}
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO), errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
     errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN, errno.EBUSY, errno.EHOSTUNREACH, errno.ENETUNREACH}
)


def is_transient(e: BaseException) -> bool:
    """Whether a failed remote operation is worth another try (network trouble, throttling, 5xx)."""
    if isinstance(e, (FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    response = getattr(e, "response", None)  # botocore ClientError: the S3 error code and HTTP status
    if isinstance(response, dict):
        err = response.get("Error", {}) or {}
        status = str((response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode", ""))
        return str(err.get("Code", "")) in _TRANSIENT_CODES or status.startswith("5")
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    # botocore/aiohttp connection and timeout errors are not OSErrors; match them by class name, so that this
    # module does not import either (both only exist when s3fs is in use).
    names = {c.__name__ for c in type(e).__mro__}
    return bool(
        names
        & {"EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError",
           "HTTPClientError", "IncompleteRead", "ClientPayloadError", "ServerDisconnectedError",
           "ClientConnectionError", "ClientOSError", "ResponseParserError", "FSTimeoutError"}
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _storage_error(e: BaseException, what: str, where: str, attempts: int = 1) -> StorageError:
    if isinstance(e, StorageError):
        return e
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return StorageError(f"{where}: no space left on device while {what}; free space or choose another location")
    if isinstance(e, PermissionError):
        return StorageError(
            f"{where}: permission denied while {what} ({_one_line(e)}); check the credentials (AWS_* environment) "
            "or file permissions"
        )
    if attempts > 1:
        return StorageError(
            f"{where}: {what} failed after {attempts} tries: {type(e).__name__}: {_one_line(e)}; the storage is "
            "unreachable or overloaded, try again later"
        )
    return StorageError(f"{where}: {what} failed: {type(e).__name__}: {_one_line(e)}")


class Storage:
    """A directory-like location: a local directory or an fsspec URL prefix."""

    def __init__(self, location: str, fs=None, retry: RetryPolicy | None = None):
        self.location = _strip_file_scheme(location).rstrip("/") or "/"
        self.is_local = not is_url(self.location)
        self._fs = fs
        self.retry = retry
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

    @property
    def is_s3(self) -> bool:
        return self.location.startswith(("s3://", "s3a://"))

    @property
    def seekable_writes(self) -> bool:
        """Whether :meth:`open_write` gives a seekable file (local disk; S3, which spools to a local file).

        A writer can then leave room for a header, stream the data behind it and seek back to write the header,
        instead of spooling the whole file once more; other fsspec files are write-once streams.
        """
        return self.is_local or self.is_s3

    def child(self, relpath: str) -> "Storage":
        return Storage(join(self.location, relpath), fs=None if self.is_local else self.fs, retry=self.retry)

    def path(self, relpath: str = "") -> str:
        """The full path (local) or URL of ``relpath`` below this location."""
        return join(self.location, relpath)

    def _fspath(self, relpath: str = "") -> str:
        # fsspec methods take the protocol-less path for most filesystems; strip_protocol handles each.
        return self.fs._strip_protocol(self.path(relpath))

    def _remote(self, op: Callable[[], T], what: str, relpath: str = "") -> T:
        """Run one remote operation, retrying transient errors with backoff.

        ``FileNotFoundError`` passes through (callers give it a meaning: a missing file), except when the whole
        bucket is missing; every other final failure becomes a one-line :class:`StorageError`.
        """
        policy = self.retry or DEFAULT_RETRY
        for attempt in range(policy.attempts):
            try:
                return op()
            except (StorageError, KeyboardInterrupt):
                raise
            except FileNotFoundError:
                self._raise_if_no_bucket(what)
                raise
            except Exception as e:  # noqa: BLE001 - fsspec backends raise anything; we classify and name it
                if not is_transient(e) or attempt + 1 == policy.attempts:
                    raise _storage_error(e, what, self.path(relpath), attempts=attempt + 1) from e
                time.sleep(policy.delay(attempt))
        raise StorageError(f"{self.path(relpath)}: {what} failed")  # unreachable: attempts >= 1

    def _raise_if_no_bucket(self, what: str) -> None:
        """A missing bucket is bad input (exit 2), not a missing file: say so, naming the bucket."""
        if not self.is_s3:
            return
        bucket = self._fspath().split("/", 1)[0]
        try:
            missing = not self.fs.exists(bucket)
        except FileNotFoundError:
            missing = True
        except Exception as e:  # noqa: BLE001 - the original error is the one to report; this was only a probe
            del e
            return
        if missing:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
            raise StorageError(
                f"{self.location}: bucket {bucket!r} does not exist at {endpoint} (while {what}); "
                "create it or fix the URL"
            )

    # -- reading ---------------------------------------------------------------------------------------
    def exists(self, relpath: str = "") -> bool:
        if self.is_local:
            return os.path.exists(self.path(relpath))
        return self._remote(lambda: self.fs.exists(self._fspath(relpath)), "checking existence", relpath)

    def size(self, relpath: str) -> int:
        try:
            if self.is_local:
                return os.path.getsize(self.path(relpath))
            return int(self._remote(lambda: self.fs.size(self._fspath(relpath)), "reading the size", relpath))
        except (FileNotFoundError, StorageError):
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
            what = f"reading bytes {start}..{end}"
            return bytearray(self._remote(lambda: self.fs.cat_file(self._fspath(relpath), start=start, end=end), what, relpath))
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, f"reading bytes {start}..{end}", self.path(relpath)) from e

    def read_bytes(self, relpath: str) -> bytes:
        try:
            if self.is_local:
                with open(self.path(relpath), "rb") as f:
                    return f.read()
            return self._remote(lambda: self.fs.cat_file(self._fspath(relpath)), "reading", relpath)
        except (FileNotFoundError, StorageError):
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "reading", self.path(relpath)) from e

    def read_ranges(self, ranges: Sequence[tuple[str, int | None, int | None]]) -> list[bytearray]:
        """Bytes ``[start, end)`` of each ``(relpath, start, end)``, fetched concurrently from remote storage.

        ``None`` bounds mean the start or end of the file, so ``(relpath, None, None)`` reads a whole file. On
        an object store every range is one HTTP range request and all run at once (fsspec ``cat_ranges``).
        """
        if not ranges:
            return []
        if self.is_local:
            out = []
            for relpath, start, end in ranges:
                hi = end if end is not None else self.size(relpath)
                out.append(self.read_range(relpath, start or 0, hi))  # readinto: no copy after the read
            return out
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
            raise FileNotFoundError(f"{self.location}: an object to read is missing ({_one_line(e)})") from e

    def listdir(self, relpath: str = "") -> list[str]:
        """Names (not paths) of the entries directly below ``relpath``; empty if it does not exist."""
        try:
            if self.is_local:
                p = self.path(relpath)
                return sorted(os.listdir(p)) if os.path.isdir(p) else []
            base = self._fspath(relpath).rstrip("/")

            def ls() -> list[str]:
                self.fs.invalidate_cache(base)
                if not self.fs.exists(base):
                    return []
                return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(base, detail=False)})

            names = self._remote(ls, "listing", relpath)
            if not names:
                self._raise_if_no_bucket("listing")
            return names
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "listing", self.path(relpath)) from e

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        """A binary file for writing; on local disk its data is fsynced before the context exits.

        The file is seekable where :attr:`seekable_writes` says so. On S3 the object is uploaded when the context
        exits normally; if the body raises, nothing is uploaded.
        """
        target = self.path(relpath)
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    yield f
                    f.flush()
                    os.fsync(f.fileno())
            elif self.is_s3:
                # Spool to a local temporary file, then upload it with s3fs put_file: a multipart upload whose
                # parts go up concurrently (fs.open would send them one by one), retried whole on a transient
                # error (each try reads the file afresh into a new multipart upload; s3fs aborts a failed one).
                # Memory is bounded whatever the file size: S3_UPLOAD_CONCURRENCY parts of s3_part_bytes.
                with tempfile.NamedTemporaryFile(prefix="moeckpt-upload-", dir=os.environ.get("MOECKPT_SPOOL_DIR")) as f:
                    yield f
                    f.flush()
                    size = os.fstat(f.fileno()).st_size

                    def put() -> None:
                        self.fs.put_file(
                            f.name, self._fspath(relpath),
                            chunksize=s3_part_bytes(size), max_concurrency=S3_UPLOAD_CONCURRENCY,
                        )

                    self._remote(put, "uploading", relpath)
            else:
                with self.fs.open(self._fspath(relpath), "wb") as f:
                    yield f
        except (StorageError, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001
            raise _storage_error(e, "writing", target) from e

    def write_bytes(self, relpath: str, data: bytes) -> None:
        self.write_parts(relpath, [data])

    def write_parts(self, relpath: str, parts: Sequence[bytes | bytearray | memoryview], *, fsync: bool = True) -> None:
        """Write one whole file from ``parts``; fsynced on local disk (unless ``fsync=False``).

        Remotely an object of up to :data:`JOIN_LIMIT_BYTES` is uploaded from one buffer in one PUT, retried as a
        whole on transient errors; a larger one is spooled through :meth:`open_write` (a bounded multipart upload
        on S3) rather than joined in memory.
        """
        target = self.path(relpath)
        if self.is_local:
            try:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    for p in parts:
                        f.write(p)
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
            except (StorageError, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001
                raise _storage_error(e, "writing", target) from e
            return
        if sum(memoryview(p).nbytes for p in parts) > JOIN_LIMIT_BYTES:
            # A large object is not joined in memory (16 uploads in flight would hold 16 copies): spool it.
            with self.open_write(relpath) as f:
                for p in parts:
                    f.write(p)
            return
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        kwargs = {}
        if self.is_s3:
            # One PUT of the buffer as it is: s3fs pipe_file would cut a buffer of 2 parts or more into part
            # copies (bytes slices), on top of the joined buffer; JOIN_LIMIT_BYTES is below 2 parts of this size.
            kwargs["chunksize"] = JOIN_LIMIT_BYTES
        try:
            self._remote(lambda: self.fs.pipe_file(self._fspath(relpath), data, **kwargs), "writing", relpath)
        except FileNotFoundError as e:
            raise _storage_error(e, "writing", target) from e

    def makedirs(self, relpath: str = "") -> None:
        """Create the local directory (and its parents); a path that cannot be one is a one-line StorageError."""
        if self.is_local:
            try:
                os.makedirs(self.path(relpath), exist_ok=True)
            except OSError as e:
                raise StorageError(
                    f"{self.path(relpath)}: cannot create the directory ({e.strerror or e}); choose a location in a "
                    "writable directory"
                ) from None
        # object stores have no directories

    def refuse_file(self) -> None:
        """Raise :class:`DestinationNotEmptyError` if this local location is a file: a directory is about to be
        written here, and listing a file shows no entries, so a non-empty check alone would let it be replaced."""
        if self.is_local and os.path.lexists(self.location) and not os.path.isdir(self.location):
            raise DestinationNotEmptyError(
                f"{self.location}: exists and is a file, not a directory; choose another location or remove the file"
            )

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

            def rm() -> None:
                if self.fs.exists(p):
                    self.fs.rm(p, recursive=True)
                self.fs.invalidate_cache()

            self._remote(rm, "removing", relpath)
        except StorageError:
            raise
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
        # Listings are not cached: other ranks and processes write here too, and a stale listing would hide
        # a commit or show a removed step.
        opts: dict = {"use_listings_cache": False}
        if endpoint:
            opts["client_kwargs"] = {"endpoint_url": endpoint}
        # Storage retries transient errors itself (RetryPolicy): botocore's own retries on top multiplied an
        # unreachable endpoint into a minute of silence, and its 60 s connect timeout made each try that long.
        opts["config_kwargs"] = {"connect_timeout": 5, "retries": {"max_attempts": 1, "mode": "standard"}}
        return opts
    return {}


def require_exists(storage: Storage, relpath: str, what: str) -> None:
    if not storage.exists(relpath):
        raise NotCommittedError(f"{storage.path(relpath)}: {what} not found")
