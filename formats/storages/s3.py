"""S3 (``s3://`` through s3fs): bounded multipart uploads, aborted when a save is interrupted, and stale ones listed.

Uploads: a file written through :meth:`S3Storage.open_write` is spooled to a local temporary file, then uploaded
with s3fs ``put_file``: a multipart upload whose parts go up concurrently (``fs.open`` would send them one by one),
retried whole on a transient error (each try reads the file afresh into a new multipart upload; s3fs aborts a
failed one). Memory is bounded whatever the file size: :data:`S3_UPLOAD_CONCURRENCY` parts of
:func:`s3_part_bytes`.

Parts of a multipart upload that is never completed nor aborted stay stored, and billed, until someone aborts it.
So the filesystem this module makes remembers the uploads in flight: :meth:`S3Storage.cancel_uploads` (called by
a save that fails or is interrupted, SIGINT and SIGTERM included) aborts those below the save's location and
refuses the requests its writer threads still send, and :meth:`S3Storage.stale_uploads` lists what a killed
process left (``moeckpt gc`` and the trainer's retention abort them).
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import StorageError
from ..storage import one_line, storage_error
from . import url as _url
from .url import FsspecStorage

log = logging.getLogger(__name__)

#: the part size of S3 multipart uploads of spooled files. s3fs's default is 50 MiB parts, 10 in flight per
#: upload (``S3FileSystem.max_concurrency``): 500 MiB of parts in memory per upload and per writer thread, and a
#: file under 100 MiB read whole into memory for one PUT. 16 MiB keeps well above S3's 5 MiB minimum part (few
#: requests) while a file under 2 parts (32 MiB) is still one PUT; objects over 10,000 parts x 16 MiB (156 GiB)
#: get larger parts (:func:`s3_part_bytes`).
S3_PART_BYTES = 16 * 2**20

#: the parts of one upload in flight at once: memory per upload is S3_PART_BYTES x this, while four parts' round
#: trips still overlap; the writers upload in parallel too.
S3_UPLOAD_CONCURRENCY = 4

#: S3 allows at most this many parts in one multipart upload.
_S3_MAX_PARTS = 10_000

#: the requests that send data; refused below a cancelled location.
_UPLOAD_METHODS = frozenset({"create_multipart_upload", "upload_part", "complete_multipart_upload", "put_object"})


def s3_part_bytes(size: int) -> int:
    """The multipart part size for an S3 object of ``size`` bytes: :data:`S3_PART_BYTES`, larger if needed."""
    return max(S3_PART_BYTES, -(-size // _S3_MAX_PARTS))


def _age(now: datetime.datetime, when: object) -> float:
    """Seconds from ``when`` (a timestamp S3 returned) to ``now``; infinite when S3 gave none."""
    return (now - when).total_seconds() if isinstance(when, datetime.datetime) else float("inf")


class UploadCancelledError(Exception):
    """An upload below a location whose save was interrupted (raised inside s3fs, which then aborts it)."""


@dataclass(frozen=True)
class S3Upload:
    """A multipart upload found on S3."""

    relpath: str
    age_s: float
    bucket: str
    key: str
    upload_id: str


class _Tracker:
    """The multipart uploads in flight on one filesystem, and the locations whose uploads are refused."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight: dict[tuple[str, str], set[str]] = {}
        self.cancelled: set[str] = set()

    def refused(self, bucket: str, key: str) -> bool:
        path = f"{bucket}/{key}"
        with self.lock:
            return any(path == p or path.startswith(p + "/") for p in self.cancelled)

    def started(self, bucket: str, key: str, upload_id: str) -> None:
        with self.lock:
            self.in_flight.setdefault((bucket, key), set()).add(upload_id)

    def ended(self, bucket: str, key: str, upload_id: str | None) -> None:
        with self.lock:
            ids = self.in_flight.get((bucket, key))
            if ids is not None:
                ids.discard(upload_id or "")
                if not ids:
                    del self.in_flight[(bucket, key)]

    def below(self, prefix: str) -> list[tuple[str, str, str]]:
        with self.lock:
            return [
                (b, k, u)
                for (b, k), ids in self.in_flight.items()
                if f"{b}/{k}" == prefix or f"{b}/{k}".startswith(prefix + "/")
                for u in ids
            ]


_FS_CLASS: type | None = None


def _tracked_fs_class() -> type:
    """``s3fs.S3FileSystem`` that records the multipart uploads it starts and refuses those cancelled."""
    global _FS_CLASS
    if _FS_CLASS is not None:
        return _FS_CLASS
    import s3fs

    class TrackedS3FileSystem(s3fs.S3FileSystem):
        """Every S3 request of s3fs passes through ``_call_s3``: the one place to see uploads start and end."""

        @property
        def moeckpt_tracker(self) -> _Tracker:
            tracker = self.__dict__.get("_moeckpt_tracker")
            if tracker is None:
                tracker = self.__dict__.setdefault("_moeckpt_tracker", _Tracker())
            return tracker

        async def _call_s3(self, method: str, *akwarglist: Any, **kwargs: Any) -> Any:
            tracker = self.moeckpt_tracker
            bucket, key = str(kwargs.get("Bucket", "")), str(kwargs.get("Key", ""))
            if method in _UPLOAD_METHODS and tracker.refused(bucket, key):
                raise UploadCancelledError(f"s3://{bucket}/{key}: the save was interrupted; upload refused")
            out = await super()._call_s3(method, *akwarglist, **kwargs)
            if method == "create_multipart_upload":
                tracker.started(bucket, key, out["UploadId"])
            elif method in ("complete_multipart_upload", "abort_multipart_upload"):
                tracker.ended(bucket, key, kwargs.get("UploadId"))
            return out

    _FS_CLASS = TrackedS3FileSystem
    return _FS_CLASS


def _storage_options() -> dict[str, Any]:
    """s3fs options from the standard environment (``AWS_ENDPOINT_URL_S3`` is not read by every s3fs)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    # Listings are not cached: other ranks and processes write here too, and a stale listing would hide a commit
    # or show a removed step.
    opts: dict[str, Any] = {"use_listings_cache": False}
    if endpoint:
        opts["client_kwargs"] = {"endpoint_url": endpoint}
    # Storage retries transient errors itself (RetryPolicy): botocore's own retries on top multiplied an unreachable
    # endpoint into a minute of silence, and its 60 s connect timeout made each try that long.
    opts["config_kwargs"] = {"connect_timeout": 5, "retries": {"max_attempts": 1, "mode": "standard"}}
    return opts


class S3Storage(FsspecStorage):
    """An ``s3://bucket/prefix`` location."""

    #: open_write spools to a local file, so the writer can seek back before the upload.
    seekable_writes = True

    def _make_fs(self) -> Any:
        return _tracked_fs_class()(**_storage_options())

    def _missing_container(self, what: str) -> None:
        """A missing bucket is bad input (exit 2), not a missing file: say so, naming the bucket."""
        bucket = self._fspath().split("/", 1)[0]
        try:
            missing = not self.fs.exists(bucket)
        except FileNotFoundError:
            missing = True
        except Exception:  # noqa: BLE001 - the original error is the one to report; this was only a probe
            return
        if missing:
            endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
            raise StorageError(
                f"{self.location}: bucket {bucket!r} does not exist at {endpoint} (while {what}); create it or fix the URL"
            )

    # -- writing ---------------------------------------------------------------------------------------
    @contextmanager
    def open_write(self, relpath: str) -> Iterator[BinaryIO]:
        """A local spool file, uploaded when the context exits normally; if the body raises, nothing is uploaded."""
        target = self.path(relpath)
        try:
            with tempfile.NamedTemporaryFile(prefix="moeckpt-upload-", dir=os.environ.get("MOECKPT_SPOOL_DIR")) as f:
                yield f  # type: ignore[misc]
                f.flush()
                size = os.fstat(f.fileno()).st_size

                def put() -> None:
                    self.fs.put_file(
                        f.name,
                        self._fspath(relpath),
                        chunksize=s3_part_bytes(size),
                        max_concurrency=S3_UPLOAD_CONCURRENCY,
                    )

                self._remote(put, "uploading", relpath)
        except (StorageError, KeyboardInterrupt):
            raise
        except Exception as e:
            raise storage_error(e, "writing", target) from e

    def _pipe_kwargs(self) -> dict[str, Any]:
        # One PUT of the buffer as it is: s3fs pipe_file would cut a buffer of 2 parts or more into part copies
        # (bytes slices), on top of the joined buffer; JOIN_LIMIT_BYTES is below 2 parts of this size.
        return {"chunksize": _url.JOIN_LIMIT_BYTES}

    # -- uploads in flight and stale ones ----------------------------------------------------------------
    def cancel_uploads(self) -> list[str]:
        """Refuse further uploads below this location and abort those in flight (the writer threads' s3fs calls
        then fail, and s3fs aborts what they were sending)."""
        prefix = self._fspath().rstrip("/")
        tracker = self.fs.moeckpt_tracker
        with tracker.lock:
            tracker.cancelled.add(prefix)
        aborted = []
        for bucket, key, upload_id in tracker.below(prefix):
            if self._abort(bucket, key, upload_id):
                aborted.append(key)
            tracker.ended(bucket, key, upload_id)
        if aborted:
            log.info("aborted %d multipart upload(s) in flight below %s", len(aborted), self.location)
        return aborted

    def allow_uploads(self) -> None:
        prefix = self._fspath().rstrip("/")
        tracker = self.fs.moeckpt_tracker
        with tracker.lock:
            tracker.cancelled = {p for p in tracker.cancelled if not (p == prefix or p.startswith(prefix + "/"))}

    def stale_uploads(self, older_than_s: float) -> list[S3Upload]:
        """Incomplete multipart uploads below this location with no activity (start, or a part uploaded) for more
        than ``older_than_s`` seconds: an upload still receiving parts belongs to a save in flight."""
        prefix = self._fspath().rstrip("/")
        bucket, _, key_prefix = prefix.partition("/")
        now = datetime.datetime.now(datetime.UTC)
        out: list[S3Upload] = []
        for u in self._list(
            "list_multipart_uploads", "Uploads", Bucket=bucket, Prefix=key_prefix + "/" if key_prefix else ""
        ):
            age = _age(now, u.get("Initiated"))
            if age < older_than_s:
                continue
            for part in self._list("list_parts", "Parts", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]):
                age = min(age, _age(now, part.get("LastModified")))
            if age >= older_than_s:
                rel = u["Key"][len(key_prefix) + 1 :] if key_prefix else u["Key"]
                out.append(S3Upload(rel, age, bucket, u["Key"], u["UploadId"]))
        return out

    def _list(self, method: str, field: str, **kwargs: Any) -> Iterator[dict]:
        """The items of a paginated S3 listing (``list_multipart_uploads`` or ``list_parts``)."""
        markers: dict[str, Any] = {}
        while True:
            page = self._remote(functools.partial(self.fs.call_s3, method, **kwargs, **markers), f"calling {method}")
            yield from page.get(field, []) or []
            if not page.get("IsTruncated"):
                return
            if method == "list_parts":
                markers = {"PartNumberMarker": page.get("NextPartNumberMarker", 0)}
            else:
                markers = {
                    "KeyMarker": page.get("NextKeyMarker", ""),
                    "UploadIdMarker": page.get("NextUploadIdMarker", ""),
                }

    def abort_upload(self, upload: Any) -> None:
        if not isinstance(upload, S3Upload):
            raise StorageError(f"{self.location}: {upload!r} is not an S3 upload listed by stale_uploads")
        self._abort(upload.bucket, upload.key, upload.upload_id)

    def _abort(self, bucket: str, key: str, upload_id: str) -> bool:
        """Abort one multipart upload; False if it was gone already (completed, or aborted by s3fs)."""
        try:
            self._remote(
                lambda: self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id),
                "aborting a multipart upload",
            )
            return True
        except (FileNotFoundError, StorageError) as e:
            if "NoSuchUpload" in one_line(e) or isinstance(e, FileNotFoundError):
                return False
            raise
