"""The process settings a reshard or a load runs under: no cyclic collector pauses, one torch thread per worker,
and each rank's share of its host's cores."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager


def host_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cores_per_rank(group=None) -> int:
    """This host's cores (those the process may run on) shared by the ranks on it: ``LOCAL_WORLD_SIZE`` where
    torchrun sets it, else every rank of ``group``; at least 1.

    What a rank's own thread pools (its file writers, its in-place readers) are sized by: a rank's pool as large
    as the whole host, on every rank of the host, only makes the threads take turns."""
    from . import collectives  # here, not at import: torch.distributed is not what a command's options need

    cores = host_cores()
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else collectives.world_size(group)
    return max(1, cores // max(1, ranks))


@contextmanager
def paused_gc() -> Iterator[None]:
    """Keep the cyclic garbage collector off for the duration (restored afterwards).

    Planning and reading a checkpoint allocate some 100,000 small objects (boxes, read items, tuples), which
    trigger full collections, and each full collection walks every object of the process, torch's included: a
    multi-rank load spent a fifth of its time in them (docs/benchmarks/README.md). The objects are freed by
    reference counting; cycles made meanwhile are collected after.

    The objects made meanwhile leave the pause in the oldest generation, not the youngest: the first collection
    after the pause would otherwise walk every one of them at once (a plan at 1,024 ranks holds millions, and that
    one walk took longer than making them). Moving them is a splice of the collector's lists (``gc.freeze`` then
    ``gc.unfreeze``); where the process froze objects of its own before (the CLI does after its imports), ours are
    frozen beside them instead, so theirs stay frozen.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            frozen_before = gc.get_freeze_count()
            gc.freeze()
            if not frozen_before:
                gc.unfreeze()
            gc.enable()


@contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run torch ops on one intra-op thread each for the duration (restored afterwards).

    The resharder parallelises over pieces with its own workers; letting every copy also fan out over torch's
    thread pool oversubscribes the cores, and strided copies then crawl (docs/benchmarks/README.md).
    """
    import torch  # here, not at import: the pure planner uses paused_gc without torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def after_fork_in_child() -> None:
    """Called first in a forked writer process, before it starts threads.

    torch replaces its intra-op thread pool in a forked child on first use, and that replacement is not
    thread-safe: writer threads making their first parallel copies at once can find no pool and abort ("pool
    INTERNAL ASSERT FAILED ... Invalid thread pool!", seen on 16 cores). One use here, in one thread, replaces it
    before any writer thread runs."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
