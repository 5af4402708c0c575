"""``moeckpt`` commands run one at a time under a memory and a time bound, each in a fresh process.

A test that feeds hostile input must not itself run without bound when the code under test regresses (a memo
bomb grows past every machine's memory). :class:`BoundedCli` starts one worker process that imports the CLI once
(torch and all: seconds), then runs each command in a child forked from it, so a case costs a fork and not an
interpreter start. The child's address space is capped at what it had at the fork plus ``limit_mb``
(``RLIMIT_AS``: the interpreter and torch alone take more than the bound the test asks for, so the bound is on
what the command adds), and it is killed after ``timeout_s``. Each run reports the exit code (negative: the
signal that ended it), stderr, whether it timed out, the wall time and the memory the child added.

``python -m tests.bounded_cli`` is the worker: one JSON request per line on stdin, one JSON result per line on
stdout.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .proc_helpers import close_and_wait


@dataclass(frozen=True)
class Ran:
    """What one bounded command did."""

    rc: int
    stderr: str
    timed_out: bool
    wall_s: float
    added_mb: float

    def ended_in_one_line(self) -> bool:
        """Exit 1 or 2, one line on stderr, no traceback: how the CLI reports bad input."""
        return (
            self.rc in (1, 2)
            and not self.timed_out
            and self.stderr.count("\n") == 1
            and self.stderr.startswith("moeckpt: error: ")
            and "Traceback" not in self.stderr
        )


class BoundedCli:
    """The worker process; ``run(*args)`` runs ``moeckpt ARGS`` in a bounded child of it."""

    def __init__(self, limit_mb: int = 500, timeout_s: float = 10.0) -> None:
        self.limit_mb = limit_mb
        self.timeout_s = timeout_s
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bounded_cli"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=root,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])},
        )
        ready = self.proc.stdout.readline() if self.proc.stdout else ""
        if json.loads(ready or "{}").get("ready") is not True:
            raise RuntimeError(f"the bounded CLI worker did not start: {ready!r}")

    def run(self, *args: object) -> Ran:
        request = {"args": [str(a) for a in args], "limit_mb": self.limit_mb, "timeout_s": self.timeout_s}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bounded CLI worker died (exit {self.proc.wait()})")
        return Ran(**json.loads(line))

    def close(self) -> None:
        close_and_wait(self.proc)


def _vm_kb(pid: int | str = "self") -> tuple[int, int]:
    """``(VmSize, VmRSS)`` of a process in KiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmSize", "VmRSS"):
                fields[key] = int(rest.split()[0])
    return fields["VmSize"], fields["VmRSS"]


def _child(args: list[str], limit_mb: int, err_fd: int) -> None:
    """In the forked child: bound it, run the CLI, exit with its code (never return)."""
    code = 99
    try:
        os.dup2(err_fd, 2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        vm_kb, _ = _vm_kb()
        cap = vm_kb * 1024 + limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        from moeckpt.cli.main import main

        sys.argv = ["moeckpt", *args]
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except BaseException:  # noqa: BLE001 - reported as a traceback on stderr and exit 99: what the test refuses
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run(args: list[str], limit_mb: int, timeout_s: float) -> dict:
    err_fd, err_path = tempfile.mkstemp(prefix="bounded-cli-")
    _, rss_kb = _vm_kb()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(args, limit_mb, err_fd)
    timed_out = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - started > timeout_s:
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            timed_out = True
            break
        time.sleep(0.005)
    wall = time.monotonic() - started
    os.close(err_fd)
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    os.unlink(err_path)
    return {
        "rc": os.waitstatus_to_exitcode(status),
        "stderr": stderr,
        "timed_out": timed_out,
        "wall_s": round(wall, 3),
        "added_mb": round(max(0, usage.ru_maxrss - rss_kb) / 1024, 1),
    }


def main() -> None:
    import importlib

    from moeckpt.cli.main import COMMAND_MODULES

    # The commands' modules (torch, the trainer's mappings) imported once here, inherited by every forked child.
    for name in sys.argv[1:] or ["import-dcp"]:
        importlib.import_module(f"moeckpt.cli.{COMMAND_MODULES[name]}")
    # and what a command imports when it first runs: one run of it here that fails at once
    import contextlib
    import io

    from moeckpt.cli.main import main as cli_main

    missing = os.path.join(tempfile.gettempdir(), f"bounded-cli-missing-{os.getpid()}")
    sys.argv = ["moeckpt", "import-dcp", missing, missing + "-dst"]
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
        cli_main()

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(_run(request["args"], request["limit_mb"], request["timeout_s"])), flush=True)


if __name__ == "__main__":
    main()
