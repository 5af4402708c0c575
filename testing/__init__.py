"""Contract tests and helpers for users of moeckpt (installed as ``moeckpt.testing``).

``BackendTests`` and ``StorageTests`` are pytest suites a new backend or storage subclasses (as zarr ships
``zarr.testing.StoreTests``); the repository's own backends and storages subclass them too.
"""

from .backends import BackendTests
from .storages import StorageTests
from .toy import save_toy, tensors_equal, toy_params, toy_tensors, toy_values

__all__ = [
    "BackendTests",
    "StorageTests",
    "save_toy",
    "tensors_equal",
    "toy_params",
    "toy_tensors",
    "toy_values",
]
