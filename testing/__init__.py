"""Test helpers that ship with moeckpt (``moeckpt.testing``): the local elastic drill and a local world of gloo
processes, for this repository's tests and benchmarks and for anyone testing code built on moeckpt."""

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

__all__ = [
    "DrillError",
    "DrillResult",
    "LocalNode",
    "cpu_drill_args",
    "free_port",
    "kill_node",
    "plot_drill",
    "run_local_world",
    "run_shrink_grow_drill",
    "start_node",
]
