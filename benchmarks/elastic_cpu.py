"""Issue 9's scenario on CPU: 8 gloo workers in tp=2 ep=2 dp=4, lose half, resume resharded on 4, grow back to 8.

Each phase is a ``moeckpt train --nproc N`` run on the same run directory (a restart, as a scheduler does after
losing nodes). Records: the loss curve across both changes, time from the failure to the first new step, bytes
read from storage against bytes needed at each resume, and training time blocked per async save.

Usage: ``python benchmarks/elastic_cpu.py --out docs/benchmarks`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# --resume-reads exchange: the ranks of a multi-node job exchange replicated tensors at a resume; on this one host
# `auto` would have each read its own (the page cache shares them), and the storage-read figure would not show it.
COMMON = [
    "--model",
    "zaya-tiny",
    "--tp",
    "2",
    "--ep",
    "2",
    "--steps",
    "36",
    "--save-every",
    "4",
    "--global-batch",
    "16",
    "--seq-len",
    "64",
    "--warmup-steps",
    "3",
    "--seed",
    "5",
    "--cpu",
    "--resume-reads",
    "exchange",
]


def _train(run: str, nproc: int, *extra: str) -> tuple[int, float]:
    t0 = time.time()
    cmd = [sys.executable, "-m", "moeckpt.cli.main", "train", *COMMON, "--run-dir", run, "--nproc", str(nproc), *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode
    return code, t0


def _rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _last_before(rows: list[dict], end: int) -> float:
    return max(r["time"] for r in rows[:end] if "loss" in r)


def _first_after(steps: list[dict], end: int, rows: list[dict]) -> float:
    return min(r["time"] for r in rows[end:] if "loss" in r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--dir", default="/tmp/moeckpt-elastic-cpu")
    args = ap.parse_args()
    run = os.path.join(args.dir, "run")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    phases = []
    code, _ = _train(run, 8, "--inject", "kill:rank=5,step=14")  # a node of 4 workers is lost at step 14
    phases.append({"workers": 8, "exit": code, "rows": len(_rows(run))})
    code, _ = _train(run, 4, "--stop-at", "24")
    phases.append({"workers": 4, "exit": code, "rows": len(_rows(run))})
    code, _ = _train(run, 8)
    phases.append({"workers": 8, "exit": code, "rows": len(_rows(run))})

    rows = _rows(run)
    resumes = [r for r in rows if r.get("event") == "resume"]
    steps = [r for r in rows if "loss" in r]
    # first step record written after the failure: its wall time is not logged, so time the restart phase instead
    result = {
        "scenario": "zaya-tiny, tp2 ep2 dp4 (8 gloo workers) -> worker killed at step 14 -> tp2 ep2 dp2 (4) -> "
        "tp2 ep2 dp4 (8)",
        "phases": phases,
        "resumes": resumes,
        # storage reads of all ranks together, against one copy of the logical state (params + optimizer)
        "read_over_state": [r["bytes_read"] / r["state_bytes"] for r in resumes],
        "save_blocked_s": [r["save_blocked_s"] for r in steps if r.get("save_blocked_s")],
        # from the end of the last step before the kill to the end of the first step after the resume:
        # failure detection, teardown, restart of 4 processes, resharded load and one step
        "failure_to_first_new_step_s": _first_after(steps, phases[0]["rows"], rows)
        - _last_before(rows, phases[0]["rows"]),
        "losses": [(r["step"], r["world"], r["loss"]) for r in steps],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "elastic_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    start = 0
    labels = ["8 workers (tp2 ep2 dp4)", "4 workers, resharded (tp2 ep2 dp2)", "8 workers again (tp2 ep2 dp4)"]
    for label, ph in zip(labels, phases):
        part = [r for r in rows[start : ph["rows"]] if "loss" in r]
        ax.plot([r["step"] for r in part], [r["loss"] for r in part], marker=".", label=label)
        start = ph["rows"]
    ax.axvline(14, color="red", linestyle=":", label="worker 5 killed at step 14: job restarted on 4")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("8 -> 4 -> 8 gloo workers on CPU, resharded at every resume")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "elastic_cpu.png"), dpi=110)
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1))


if __name__ == "__main__":
    main()
