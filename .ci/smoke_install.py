"""What a user of a plain ``pip install moeckpt`` (no extra: no transformers, matplotlib, pytest or moto) can do.

Run in a venv with that install, from a directory outside the checkout: ``python .ci/smoke_install.py WORKDIR``.
Every command's ``--help``, the library (``moeckpt.save``/``load``, ``moeckpt.dcp`` under ``dcp.save``), and the
commands on a small checkpoint; ``moeckpt demo`` says in one line which extra it needs and exits 2. No output may
hold a traceback. Exit 1 naming each failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LIBRARY = r"""
import sys
import torch
import torch.distributed.checkpoint as dcp
import moeckpt
import moeckpt.dcp
import moeckpt.testing  # the contract suites need pytest; the package itself does not

root = sys.argv[1]
state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
moeckpt.save(state, root + "/lib")
back = {"w": torch.empty(3, 4), "b": torch.empty(5, dtype=torch.bfloat16)}
moeckpt.load(back, root + "/lib")
assert all(torch.equal(state[k], back[k]) for k in state), "moeckpt.load read other values"
dcp.save(state, storage_writer=moeckpt.dcp.StorageWriter(root + "/via-dcp"))
again = {"w": torch.empty(3, 4), "b": torch.empty(5, dtype=torch.bfloat16)}
dcp.load(again, storage_reader=moeckpt.dcp.StorageReader(root + "/via-dcp"))
assert all(torch.equal(state[k], again[k]) for k in state), "dcp.load through moeckpt.dcp read other values"
dcp.save({"weight": torch.randn(8, 4)}, checkpoint_id=root + "/plain-dcp")  # torch's own writer, for import-dcp
try:
    from moeckpt.testing import BackendTests  # noqa: F401
except ImportError as e:
    assert "pip install pytest" in str(e) and "\n" not in str(e), f"not one line naming pytest: {e!r}"
else:
    raise AssertionError("BackendTests imported without pytest installed?")
print("library ok")
"""


def run(args: list[str], want: int, failures: list[str], cwd: Path) -> str:
    p = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    shown = " ".join(args[:4]) + (" ..." if len(args) > 4 else "")
    if p.returncode != want:
        failures.append(f"`{shown}` exit {p.returncode}, want {want}: {(p.stderr or p.stdout).strip()[-800:]}")
    elif "Traceback" in p.stdout + p.stderr:
        failures.append(f"`{shown}` printed a traceback: {p.stderr.strip()[-800:]}")
    else:
        print(f"ok   {shown}")
    return p.stdout + p.stderr


def main(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    for absent in ("transformers", "matplotlib", "pytest", "moto"):
        probe = subprocess.run([sys.executable, "-c", f"import {absent}"], capture_output=True)
        if probe.returncode == 0:
            failures.append(f"{absent} is installed: this check is for an install with no extra")
    top = run(["moeckpt", "--help"], 0, failures, work)
    commands = [ln.split()[0] for ln in top.split("Commands:", 1)[-1].splitlines() if ln.startswith("  ")]
    if len(commands) < 10:
        failures.append(f"moeckpt --help lists {len(commands)} commands: {commands}")
    for c in commands:
        run(["moeckpt", c, "--help"], 0, failures, work)
    run([sys.executable, "-c", LIBRARY, str(work)], 0, failures, work)
    m = ["moeckpt"]
    run(m + ["init", "ck", "--model", "zaya-tiny", "--ep", "2", "--dp", "2", "--with-optimizer"], 0, failures, work)
    run(m + ["inspect", "ck"], 0, failures, work)
    run(m + ["verify", "ck"], 0, failures, work)
    run(m + ["init", "ck1", "--model", "zaya-tiny", "--with-optimizer"], 0, failures, work)
    run(m + ["diff", "ck", "ck1"], 0, failures, work)
    run(m + ["reshard", "ck", "ck-zarr", "--ep", "1", "--dp", "2", "--format", "zarr"], 0, failures, work)
    run(m + ["diff", "ck", "ck-zarr"], 0, failures, work)
    run(m + ["export-hf", "ck", "hf"], 0, failures, work)
    run(m + ["import-hf", "hf", "ck-hf", "--dp", "2"], 0, failures, work)
    run(m + ["import-dcp", "plain-dcp", "ck-dcp", "--mapping", "none"], 0, failures, work)
    run(m + ["export-dcp", "ck", "back-to-dcp"], 0, failures, work)
    run(
        m + ["train", "--model", "zaya-tiny", "--run-dir", "run", "--steps", "3", "--save-every", "1"],
        0,
        failures,
        work,
    )
    run(m + ["eval", "run", "--batches", "1"], 0, failures, work)
    run(m + ["gc", "run", "--keep-last", "1"], 0, failures, work)
    out = run(m + ["demo", "--dir", "demo"], 2, failures, work)
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    if len(lines) != 1 or "moeckpt[demo]" not in out:
        failures.append(f"moeckpt demo without its extra: want one line naming moeckpt[demo], got {out!r}")
    for f in failures:
        print(f"FAIL {f}", file=sys.stderr)
    print(f"smoke_install: {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(Path(sys.argv[1]).resolve()))
