"""A world of local CPU processes joined by gloo, for tests and benchmarks of collective code.

Training runs use torchrun (``moeckpt train --nproc N``); tests of one collective function want something
lighter: :func:`run_local_world` starts ``world`` fresh processes on 127.0.0.1, runs ``fn(rank, *args)`` in each
and reports the first failure (the root cause, not its echo on the other ranks).

The processes are forked from a server that imported torch once (multiprocessing's ``forkserver``, started at the
first call and kept by the calling process), not started as new interpreters that import torch each: a world
then starts in milliseconds instead of seconds of CPU per rank, which a test suite of many small worlds pays
hundreds of times. Each process gets the caller's environment and working directory of the moment of the call,
as a new interpreter would. Where ``forkserver`` does not exist (Windows), they are spawned.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from moeckpt.trainer.parallel import LaunchError

log = logging.getLogger(__name__)

__all__ = ["free_port", "run_local_world"]

#: how long the peers of a failed rank may take to fail too (and record their failure) before they are killed.
PEER_SETTLE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: what the fork server imports once, before it forks any world's processes.
PRELOAD = ("torch", "torch.distributed", __name__)


def _start_method() -> str:
    """``forkserver`` with torch preloaded where the platform has it, else ``spawn``."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Global to the process and read when the server starts (at the first world); later calls change nothing.
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def _local_worker(
    rank: int,
    fn: Callable,
    world: int,
    port: int,
    timeout_s: float,
    error_dir: str,
    args: tuple,
    environ: dict[str, str],
) -> None:
    failed = False
    # A process forked from the server has the server's environment, taken when the server started: give it the
    # caller's of this call, as a spawned interpreter would have (a test sets variables for one world).
    os.environ.clear()
    os.environ.update(environ)
    try:
        dist.init_process_group(  # inside the try: a rank that cannot join records why, as any failure
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        fn(rank, *args)
        # Every rank finished before any tears its gloo connections down: a peer still in its last collective
        # when another's process group goes away can abort ("terminate called without an active exception").
        dist.barrier()
        # Past this point every rank has done all its work; run_local_world tells an abort during teardown from
        # a failure by these marks.
        with open(os.path.join(error_dir, f"rank{rank}.done"), "w"):
            pass
    except BaseException as e:  # noqa: BLE001 - recorded for the parent, then re-raised
        # When one rank fails, its peers fail a moment later in a collective ("connection closed by peer"). Which
        # of them the parent notices first is a race, so each rank records when it failed and the parent reports
        # the earliest failure: the root cause, not its echo.
        record = {
            "rank": rank,
            "time": time.time(),
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        with open(os.path.join(error_dir, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)
        failed = True
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if failed:
        # An exit code instead of a raise: torch.multiprocessing would pickle the traceback into a
        # pytorch-errorfile-*.pickle in the temporary directory that nobody removes; the JSON record above says it.
        sys.exit(1)


def _first_failure(error_dir: str, world: int, wait_s: float = 5.0) -> dict | None:
    """The earliest failure any rank recorded in ``error_dir`` (waits briefly for ranks still writing theirs)."""
    deadline = time.monotonic() + wait_s
    records: list[dict] = []
    while True:
        records = []
        for rank in range(world):
            try:
                with open(os.path.join(error_dir, f"rank{rank}.json")) as f:
                    records.append(json.load(f))
            except (OSError, ValueError):
                continue
        if records or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return min(records, key=lambda r: r["time"]) if records else None


def run_local_world(fn: Callable, world: int, *args: Any, timeout_s: float = 120.0) -> None:
    """Run ``fn(rank, *args)`` in ``world`` fresh CPU processes joined by gloo on 127.0.0.1 (tests, benchmarks),
    forked from a server that imported torch once (see the module's docstring).

    ``fn`` must be importable (a module-level function). A failure in any rank is raised here; a rank still running
    after ``timeout_s`` seconds is killed and reported as :class:`~moeckpt.trainer.parallel.LaunchError`, so a
    broken collective cannot hang the caller. Nothing is left in the temporary directory.
    """
    import torch.multiprocessing as mp

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="moeckpt-local-world-") as error_dir:
        ctx = mp.start_processes(
            _local_worker,
            args=(fn, world, port, min(timeout_s, 60.0), error_dir, args, dict(os.environ)),
            nprocs=world,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    for p in ctx.processes:
                        p.join(5)
                    raise LaunchError(
                        f"{world} local processes running {fn.__name__} did not finish within {timeout_s:.0f} s"
                    )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # The peers of a failed rank fail a moment later in a collective and record why; on a loaded machine
            # that moment can be seconds, and a peer killed first leaves no record (the root cause lost).
            settle = time.monotonic() + PEER_SETTLE_S
            for p in ctx.processes:
                p.join(max(0.0, settle - time.monotonic()))
            for p in ctx.processes:  # still in a collective: nothing more will come from it
                if p.is_alive():
                    p.kill()
                p.join(5)
            if (
                isinstance(e, mp.ProcessExitedException)
                and e.signal_name == "SIGABRT"
                and all(os.path.exists(os.path.join(error_dir, f"rank{r}.done")) for r in range(world))
            ):
                # Every rank had finished ``fn`` and passed the final barrier: the abort came from torch's
                # teardown of gloo at exit (seen rarely on loaded machines), after all the work was done.
                log.warning("%s: rank %d aborted in teardown after every rank finished", fn.__name__, e.error_index)
                return
            first = _first_failure(error_dir, world)
            if first is None:
                raise
            # A rank killed by a signal (an abort, a segfault) leaves no record, and its peers' records are then
            # often its echo ("connection reset by peer"): name it beside the first record.
            silent = ""
            if isinstance(e, mp.ProcessExitedException) and not os.path.exists(
                os.path.join(error_dir, f"rank{e.error_index}.json")
            ):
                how = e.signal_name or f"exit code {e.exit_code}"
                silent = f"; rank {e.error_index} exited with {how} and left no record: it may be the cause"
            raise LaunchError(
                f"rank {first['rank']} of {world} running {fn.__name__} failed first: {first['error']}{silent}\n"
                f"{first['traceback']}"
            ) from e
        finally:
            for path in ctx.error_files:  # a rank killed from outside may still have written one
                if path and os.path.exists(path):
                    os.remove(path)
