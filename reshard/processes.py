"""Offline writers in forked worker processes, each reporting over a pipe in JSON lines.

An offline reshard spends its time in Python: per chunk it reads, verifies, re-slices, hashes and writes. Run by
threads of one interpreter, the writers wait on each other's interpreter lock, and handing it around took a large
share of their CPU time (docs/benchmarks/README.md). Forked processes share nothing at run time, so each writer
runs its loop on a core of its own.

A child inherits the plan and the open source description from the parent (``fork``: nothing is serialised on the
way in) and sends back lines of JSON, never pickles: ``{"bytes": n}`` as it writes (for the progress bar),
``{"done": [...]}`` with its results, or ``{"error": class name, "message": ...}``. A typed moeckpt error raised in
a child is raised again in the parent as the same class with the same message; a child that dies without a word
(killed, out of memory) raises :class:`WorkerProcessError` naming its exit status.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from moeckpt.formats.errors import MoeckptError

from .runtime import after_fork_in_child

T = TypeVar("T")

#: a child reports written bytes at most this often (bytes), so the pipe carries a few hundred lines per GB.
PROGRESS_EVERY_BYTES = 8 * 1024 * 1024


class WorkerProcessError(MoeckptError, RuntimeError):
    """A worker process failed without a typed error (killed by a signal, out of memory, a bug)."""


def can_fork() -> bool:
    """Whether writers can run in forked processes here (Linux; elsewhere ``fork`` is absent or unsafe)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def balanced_groups(items: Sequence[T], weights: Sequence[int], groups: int) -> list[list[T]]:
    """``items`` split into at most ``groups`` non-empty lists of about equal total weight (largest first, each
    to the lightest list so far)."""
    n = max(1, min(groups, len(items)))
    out: list[list[T]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(items)), key=lambda i: -weights[i]):
        k = load.index(min(load))
        out[k].append(items[i])
        load[k] += weights[i]
    return [g for g in out if g]


def run_forked(
    groups: Sequence[Sequence[T]],
    job: Callable[[Sequence[T], Callable[[int], None]], Any],
    on_bytes: Callable[[int], None] | None = None,
) -> list[Any]:
    """Run ``job(group, report_bytes)`` for each group in a forked child; return each child's JSON-able result.

    ``report_bytes(n)`` in a child reaches ``on_bytes`` in the parent. The first failure is raised after every
    child has been stopped and reaped.
    """
    children: list[tuple[int, int]] = []  # (pid, read end of its pipe)
    try:
        for group in groups:
            r, w = os.pipe()
            sys.stdout.flush()
            sys.stderr.flush()
            try:
                pid = os.fork()
            except OSError:
                os.close(r)
                os.close(w)
                raise
            if pid == 0:  # the child: never returns
                os.close(r)
                _child(group, job, w)
            os.close(w)
            children.append((pid, r))
        results, failure = _collect(children, on_bytes)
    except BaseException:  # interrupted, or a fork failed: no child outlives the parent's error
        _reap(children, kill=True)
        raise
    statuses = _reap(children, kill=failure is not None)
    if failure is not None:
        raise failure
    for i, (pid, _) in enumerate(children):
        if i not in results:
            raise WorkerProcessError(
                f"writer process {pid} ended without a result ({_describe(statuses[i])}); if it was killed for "
                "memory, pass fewer --workers"
            )
    return [results[i] for i in range(len(children))]


def _child(group: Sequence[T], job: Callable, fd: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent handles Ctrl-C and SIGTERM; a child just stops
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        gc.freeze()  # the inherited objects are never collected here: collections would copy their pages
        after_fork_in_child()
        out = os.fdopen(fd, "w", buffering=1)
        pending = [0]

        def report(n: int) -> None:
            pending[0] += n
            if pending[0] >= PROGRESS_EVERY_BYTES:
                out.write(json.dumps({"bytes": pending[0]}) + "\n")
                pending[0] = 0

        try:
            result = job(group, report)
            if pending[0]:
                out.write(json.dumps({"bytes": pending[0]}) + "\n")
            out.write(json.dumps({"done": result}) + "\n")
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
            out.write(json.dumps({"error": type(e).__name__, "message": str(e)}) + "\n")
            code = 1
        out.flush()
    except BaseException:  # noqa: BLE001 - the pipe itself failed: the exit status says so
        code = 2
    finally:
        # No interpreter teardown in a forked child: the parent's atexit handlers and buffers are not ours.
        os._exit(code)


def _collect(
    children: list[tuple[int, int]], on_bytes: Callable[[int], None] | None
) -> tuple[dict[int, Any], BaseException | None]:
    """Read the children's reports until every pipe is closed or one reports an error: results by child position,
    and the first error (rebuilt in this process), if any."""
    results: dict[int, Any] = {}
    buffers = {r: b"" for _, r in children}
    order = {r: i for i, (_, r) in enumerate(children)}
    with selectors.DefaultSelector() as sel:
        for _, r in children:
            sel.register(r, selectors.EVENT_READ)
        open_ends = len(children)
        while open_ends:
            for key, _ in sel.select():
                r = key.fd
                data = os.read(r, 1 << 16)
                if not data:
                    sel.unregister(r)
                    open_ends -= 1
                    continue
                buffers[r] += data
                *lines, buffers[r] = buffers[r].split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    if "bytes" in msg:
                        if on_bytes is not None:
                            on_bytes(msg["bytes"])
                    elif "done" in msg:
                        results[order[r]] = msg["done"]
                    else:
                        return results, _rebuild(msg["error"], msg["message"])
    return results, None


def _rebuild(name: str, message: str) -> BaseException:
    """The parent's copy of a child's error: the same moeckpt error class, else a :class:`WorkerProcessError`."""
    cls = _error_classes().get(name)
    if cls is not None:
        return cls(message)
    if name == "KeyboardInterrupt":
        return KeyboardInterrupt()
    return WorkerProcessError(f"a writer process failed: {name}: {message}")


def _error_classes() -> dict[str, type]:
    """Every moeckpt error class loaded, by name."""
    found: dict[str, type] = {}
    todo = [MoeckptError]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def _reap(children: list[tuple[int, int]], *, kill: bool) -> list[int]:
    """Close each child's pipe and wait for it to end, killing it first when ``kill`` (the parent is failing or was
    interrupted); the children's wait statuses. A child that has already exited stays a zombie until reaped here,
    so the kill cannot reach another process."""
    statuses = []
    for pid, r in children:
        os.close(r)
        if kill:
            os.kill(pid, signal.SIGKILL)
        statuses.append(os.waitpid(pid, 0)[1])
    return statuses


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"
