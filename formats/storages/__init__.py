"""The kinds of :class:`~moeckpt.formats.storage.Storage` (local disk, any fsspec URL, S3) and the factory that
picks one for a location: :func:`open_storage`, with :func:`register_storage` for a kind a program adds. The
abstract Storage knows none of them (no import runs from it to here)."""

from __future__ import annotations

import os
from typing import Any

from ..storage import Storage, is_url, strip_file_scheme
from .local import LocalFiles, LocalStorage
from .retry import RetryPolicy, is_transient
from .s3 import S3Storage
from .url import FsspecStorage

__all__ = [
    "FsspecStorage",
    "LocalFiles",
    "LocalStorage",
    "RetryPolicy",
    "S3Storage",
    "is_transient",
    "open_storage",
    "register_storage",
    "storage_class",
]

#: storages registered by URL scheme (``count`` -> a class), looked up before the built-in kinds.
_REGISTERED: dict[str, type[Storage]] = {}


def register_storage(scheme: str, cls: type[Storage]) -> None:
    """Make ``scheme://...`` locations open as ``cls`` (a :class:`Storage` subclass), as
    :func:`~moeckpt.formats.backend.register_backend` adds a format: e.g. :mod:`moeckpt.testing.counting`'s
    storage that keeps no data."""
    if not isinstance(scheme, str) or not scheme.isalnum() or not scheme.islower():
        raise ValueError(f"a storage scheme is a lower-case word of letters and digits, got {scheme!r}")
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise ValueError(f"a registered storage must be a Storage subclass, got {cls!r}")
    _REGISTERED[scheme] = cls


def storage_class(location: str) -> type[Storage]:
    """The :class:`Storage` subclass for ``location``: a registered scheme's, local disk, S3, or any other fsspec
    URL."""
    location = strip_file_scheme(location)
    registered = _REGISTERED.get(location.partition("://")[0]) if is_url(location) else None
    if registered is not None:
        return registered
    if not is_url(location):
        return LocalStorage
    if location.startswith(("s3://", "s3a://")):
        return S3Storage
    return FsspecStorage


def open_storage(location: str | os.PathLike[str], *, fs: Any = None, retry: Any = None) -> Storage:
    """The storage at ``location`` (a local path or ``pathlib.Path``, ``file://``, or any fsspec URL); ``fs``
    reuses an fsspec filesystem, ``retry`` (a :class:`~moeckpt.formats.storages.retry.RetryPolicy`) overrides
    the default."""
    location = os.fspath(location)
    return storage_class(location)(location, fs=fs, retry=retry)
