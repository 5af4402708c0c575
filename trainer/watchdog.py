"""A watchdog that ends a worker whose training makes no progress, with a report of where it hung.

A hung collective (a peer died without closing its sockets, a deadlocked data loader) blocks forever; the
elastic agent only restarts workers that exit. The training loop calls :meth:`Watchdog.beat` after every step; a
daemon thread checks the time since the last beat and, past the timeout, writes every thread's stack to stderr
(and to a report file in the run directory) and exits the process with code 124, so torchrun restarts the world.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

#: exit code of a worker the watchdog ended (the convention of timeout(1)).
HANG_EXIT_CODE = 124


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
        message = (
            f"moeckpt watchdog: no progress for {idle:.0f}s (timeout {self.timeout_s:.0f}s) after {self._where}; "
            f"the {self.what} hung. Stacks of every thread follow; exiting {HANG_EXIT_CODE} so the agent restarts."
        )
        print(message, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.report_path:
            try:
                os.makedirs(os.path.dirname(self.report_path) or ".", exist_ok=True)
                with open(self.report_path, "w") as f:
                    f.write(message + "\n")
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError as e:
                print(f"moeckpt watchdog: could not write {self.report_path}: {e}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT_CODE)
