"""A watchdog that ends a worker whose training makes no progress, with a report of where it hung.

A hung collective (a peer died without closing its sockets, a deadlocked data loader) blocks forever; the
elastic agent only restarts workers that exit. The training loop calls :meth:`Watchdog.beat` after every step; a
daemon thread checks the time since the last beat and, past the timeout, writes every thread's stack to a report
file (in the run directory), logs one line naming it, and exits the process with code 124, so torchrun restarts
the world.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

#: exit code of a worker the watchdog ended (the convention of timeout(1)).
HANG_EXIT_CODE = 124

log = logging.getLogger(__name__)


class Watchdog:
    """Ends the process if :meth:`beat` is not called for ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float, *, report_path: str | None = None, what: str = "training step"):
        self.timeout_s = timeout_s
        self.report_path = report_path
        self.what = what
        self._last = time.monotonic()
        self._where = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeckpt-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, where: str) -> None:
        """Record progress (``where`` names the last thing that completed, e.g. ``"step 12"``)."""
        self._last = time.monotonic()
        self._where = where

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(period):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        what = f"no progress for {idle:.0f}s (timeout {self.timeout_s:.0f}s) after {self._where}; the {self.what} hung"
        where = None
        if self.report_path:
            try:
                os.makedirs(os.path.dirname(self.report_path) or ".", exist_ok=True)
                with open(self.report_path, "w") as f:
                    f.write(f"moeckpt watchdog: {what}. Stacks of every thread:\n")
                    f.flush()
                    faulthandler.dump_traceback(file=f, all_threads=True)
                where = self.report_path
            except OSError as e:
                log.error("watchdog: could not write %s: %s", self.report_path, e)
        if where is None:  # nowhere to keep them: the stacks go to stderr after all
            log.error("watchdog: %s; stacks of every thread follow", what)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        else:
            log.error(
                "watchdog: %s; every thread's stack is in %s; exiting %d so the agent restarts the workers",
                what,
                where,
                HANG_EXIT_CODE,
            )
        for h in logging.getLogger("moeckpt").handlers:
            h.flush()
        os._exit(HANG_EXIT_CODE)
