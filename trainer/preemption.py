"""SIGTERM handling: a preemption notice becomes a checkpoint at the next step boundary, then a clean exit.

Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before killing a job. Saving inside the signal handler
would interrupt a step half way; instead the handler sets a flag, the training loop checks it after each step,
agrees with the other ranks (a flag on one rank must stop all of them at the same step), saves and exits 0.

A worker listens from its first instruction (:func:`listen_early`), so a notice that arrives while the process
still imports torch or loads its checkpoint is not lost: the loop then stops before its first step.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["PreemptionFlag", "listen_early"]

#: a SIGTERM this process received before a :class:`PreemptionFlag` listened (see :func:`listen_early`).
_EARLY = threading.Event()


def _early_handler(signum, frame) -> None:
    del signum, frame
    _EARLY.set()


def listen_early() -> None:
    """Take SIGTERM as a preemption notice from now on (call first thing in a worker process; main thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _early_handler)


class PreemptionFlag:
    """Set by SIGTERM (or SIGINT when asked); read at step boundaries."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self._event = threading.Event()
        self._previous = {}
        if _EARLY.is_set():
            self._event.set()
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        del frame
        self._event.set()

    def set(self) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def agreed(self, group=None) -> bool:
        """True on every rank if any rank was signalled (a MAX all-reduce over a CPU group)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.is_set else 0], dtype=torch.int32)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
