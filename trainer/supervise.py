"""Running torchrun's agent as a child that a signal to the launcher can always stop, with every worker reaped.

torchrun starts each worker in a session of its own, so neither Ctrl-C in a terminal nor a signal to the
launcher's process group reaches the workers: only the agent can stop them, and an agent killed outright leaves
them running as orphans. :func:`supervise` therefore starts the agent in a session of its own too (a signal meant
for the job reaches the launcher only, whether it was sent to the launcher's pid or to its process group), passes
SIGINT, SIGTERM and SIGHUP on to the agent (whose shutdown passes them on to the workers and waits for them), and
keeps a list of the agent's descendants while it runs, so that once the agent is gone nothing it started survives:
stragglers get SIGTERM, then SIGKILL. A second signal does not wait: everything is killed at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["STOP_SIGNALS", "Supervised", "alive", "descendants", "supervise"]

#: the signals that stop a supervised job.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: seconds between two looks at the agent's process tree.
_POLL_S = 0.2
#: what stragglers (processes of the tree still alive once the agent is gone) get between SIGTERM and SIGKILL.
_STRAGGLER_GRACE_S = 5.0


@dataclass(frozen=True)
class Supervised:
    """How a supervised agent ended."""

    returncode: int
    #: the first stop signal the launcher received while the agent ran, else ``None``.
    signal: int | None
    #: processes of the tree that outlived the agent and had to be killed.
    stragglers: int = 0


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process (Linux ``/proc``); empty elsewhere."""
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                out[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), collected before anything is killed."""
    kids: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        kids.setdefault(parent, []).append(child)
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        pass  # no /proc entry to read (gone, or not Linux): the signal probe below decides
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return not os.path.isdir("/proc")  # no /proc: trust kill(0)


def _kill(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # it ended meanwhile: the outcome we want


def _reap(pids: set[int]) -> int:
    """SIGTERM, then SIGKILL, whatever of ``pids`` still runs; returns how many had to be stopped."""
    left = [p for p in pids if alive(p)]
    if not left:
        return 0
    _kill(left, signal.SIGTERM)
    deadline = time.monotonic() + _STRAGGLER_GRACE_S
    while time.monotonic() < deadline and any(alive(p) for p in left):
        time.sleep(0.05)
    _kill([p for p in left if alive(p)], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in left):
        time.sleep(0.05)
    return len(left)


def supervise(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> Supervised:
    """Run ``cmd`` (torchrun's agent) until it ends, stopping it and everything it started on a stop signal.

    Only the main thread can take signals; from another thread the job simply runs to its end (and is still reaped).
    """
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)
    received: list[int] = []
    tree: set[int] = set()
    lock = threading.Lock()

    def on_signal(signum, frame) -> None:
        del frame
        with lock:
            received.append(signum)
            first = len(received) == 1
        if first:
            _kill([proc.pid], signum)  # torch's agent passes it to the workers and waits for them
        else:  # asked twice: stop waiting
            _kill([proc.pid, *tree, *descendants(proc.pid)], signal.SIGKILL)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            previous[s] = signal.signal(s, on_signal)
    try:
        while True:
            tree.update(descendants(proc.pid))
            try:
                proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if proc.poll() is None:  # an exception in this loop: the job must not outlive us
            tree.update(descendants(proc.pid))
            _kill([proc.pid], signal.SIGKILL)
            proc.wait()
        stragglers = _reap(tree)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return Supervised(returncode=proc.returncode, signal=received[0] if received else None, stragglers=stragglers)
