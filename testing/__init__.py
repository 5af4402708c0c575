"""Contract tests and helpers for users of moeckpt (installed as ``moeckpt.testing``).

``BackendTests`` and ``StorageTests`` are pytest suites a new backend or storage subclasses (as zarr ships
``zarr.testing.StoreTests``); the repository's own backends and storages subclass them too. The local elastic
drill and a local world of gloo processes live with the trainer that runs them (:mod:`moeckpt.trainer.elastic_drill`,
:mod:`moeckpt.trainer.local_world`: ``moeckpt demo`` uses them, and nothing the CLI or trainer runs imports this
package); they are named here too for anyone testing code built on moeckpt. The suites need pytest; the rest does
not.
"""

from typing import Any

from moeckpt.trainer.elastic_drill import (
    DrillError,
    DrillResult,
    LocalNode,
    cpu_drill_args,
    kill_node,
    plot_drill,
    run_shrink_grow_drill,
    start_node,
)
from moeckpt.trainer.local_world import free_port, run_local_world

from .toy import save_toy, tensors_equal, toy_params, toy_tensors, toy_values

#: the pytest suites, imported when first named: ``import moeckpt.testing`` works without pytest installed.
_SUITES = {"BackendTests": ".backends", "StorageTests": ".storages"}


def __getattr__(name: str) -> Any:
    if name in _SUITES:
        import importlib

        return getattr(importlib.import_module(_SUITES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
