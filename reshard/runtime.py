"""The process settings a reshard or a load runs under: no cyclic collector pauses, one torch thread per worker."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


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
