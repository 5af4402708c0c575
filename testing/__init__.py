"""Contract tests and helpers for users of moeckpt (installed as ``moeckpt.testing``).

``BackendTests`` and ``StorageTests`` are pytest suites a new backend or storage subclasses (as zarr ships
``zarr.testing.StoreTests``); the repository's own backends and storages subclass them too. The local elastic
drill and a local world of gloo processes serve this repository's tests and benchmarks, and anyone testing code
built on moeckpt.
"""

from .backends import BackendTests
from .elastic_drill import (
    DrillError,
    DrillResult,
    LocalNode,
    cpu_drill_args,
    kill_node,
    plot_drill,
    run_shrink_grow_drill,
    start_node,
)
from .local_world import free_port, run_local_world
from .storages import StorageTests
from .toy import save_toy, tensors_equal, toy_params, toy_tensors, toy_values

__all__ = [
    "BackendTests",
    "DrillError",
    "DrillResult",
    "LocalNode",
    "StorageTests",
    "cpu_drill_args",
    "free_port",
    "kill_node",
    "plot_drill",
    "run_local_world",
    "run_shrink_grow_drill",
    "save_toy",
    "start_node",
    "tensors_equal",
    "toy_params",
    "toy_tensors",
    "toy_values",
]
