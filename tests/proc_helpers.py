"""Real processes for the tests: start ``moeckpt`` in its own process group, watch the processes it starts
(``/proc``), send it signals, and prove that none of them survives; end a helper process that serves until its
stdin closes; run Python with some packages unimportable (an install without them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from moeckpt.trainer.supervise import alive, descendants


@dataclass
class Launched:
    proc: subprocess.Popen
    seen: set[int] = field(default_factory=set)

    def watch(self) -> None:
        """Remember every process below the launcher (workers included) as of now."""
        self.seen.update(descendants(self.proc.pid))

    def workers(self) -> list[int]:
        """Processes below the launcher that run the worker entry point."""
        out = []
        for pid in descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
                # the agent's command line names the worker module too, after its own
                if b"moeckpt.trainer.launch" in cmd and b"moeckpt.trainer.agent" not in cmd:
                    out.append(pid)
            except OSError:
                continue
        return out

    def wait_for_workers(self, n: int, timeout: float = 90) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.watch()
            w = self.workers()
            if len(w) >= n:
                return w
            if self.proc.poll() is not None:
                raise AssertionError(f"the launcher ended ({self.proc.returncode}) before {n} workers ran")
            time.sleep(0.1)
        raise AssertionError(f"{n} workers did not start within {timeout} s")

    def signal(self, sig: int, *, group: bool) -> None:
        self.watch()
        if group:
            os.killpg(self.proc.pid, sig)  # the launcher leads its own group (as a shell job does)
        else:
            os.kill(self.proc.pid, sig)

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        """Wait for the launcher, watching its tree until the end; returns (code, stdout, stderr)."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.watch()
            time.sleep(0.1)
        try:
            out, err = self.proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise
        return self.proc.returncode, out, err

    def survivors(self, grace: float = 3.0) -> list[int]:
        """Processes of the launcher's tree still alive once it ended (after a short grace)."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(alive(p) for p in self.seen):
            time.sleep(0.1)
        return [p for p in self.seen if alive(p)]

    def kill_all(self) -> None:
        for p in [self.proc.pid, *self.seen]:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def launch(*args: str, env: dict[str, str] | None = None) -> Launched:
    """``moeckpt ARGS`` as a new process group (a shell job), its output captured."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moeckpt.cli.main", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        start_new_session=True,
    )
    return Launched(proc)


def close_and_wait(proc: subprocess.Popen, timeout: float = 30) -> None:
    """End a helper process that serves until its stdin closes: close it, wait, kill it if it does not end."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_python_without(unimportable: tuple[str, ...], script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` where importing any of ``unimportable`` raises ImportError, as in an install
    without those packages; its output captured as text."""
    blocked = "".join(f"sys.modules[{name!r}] = None\n" for name in unimportable)
    return subprocess.run(
        [sys.executable, "-c", f"import sys\n{blocked}{script}", *args], capture_output=True, text=True, timeout=300
    )
