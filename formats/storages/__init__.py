"""The kinds of :class:`~moeckpt.formats.storage.Storage`: local disk, any fsspec URL, and S3."""

from .local import LocalFiles, LocalStorage
from .retry import RetryPolicy, is_transient
from .s3 import S3Storage
from .url import FsspecStorage

__all__ = ["FsspecStorage", "LocalFiles", "LocalStorage", "RetryPolicy", "S3Storage", "is_transient"]
