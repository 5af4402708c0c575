"""Issue 16 on one GPU: a worker killed mid-run and restarted by its torchrun agent resumes from the memory tier.

Two runs side by side, the same model and fault (``--inject kill:rank=0,step=K``, between two persistent saves):
with ``--memory-tier --memory-every 1`` (a memory checkpoint whenever the previous memory checkpoint is written,
beside a persistent save in flight: the ones due while a memory write is in flight are left out) and without.
For each: the tier and step the restarted worker resumed from, the steps lost, the time from the kill to its
first new step, with the phases (the agent's failure record, process start, imports, device and process-group
init, model build, load, first step); and, for the memory run, the time each save blocked training against a
bare device-to-host copy of the same bytes into pinned memory.

Writes ``OUT/memory_tier_gpu.json`` and ``OUT/memory_tier_gpu.png``.

Usage (one H200): ``python benchmarks/memory_tier_gpu.py --out docs/benchmarks/gpu`` (zaya-small, bf16; a few
minutes). Without a GPU it exits 0 saying so, unless ``--cpu`` (a small CPU run for testing:
``python benchmarks/memory_tier_gpu.py --cpu --model zaya-tiny --steps 12 --kill-at 7 --save-every 5 --batch 4
--seq 32 --dtype fp32 --out /tmp/mt-gpu``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def one_run(args, work: str, memory: bool) -> dict:
    name = "memory" if memory else "storage"
    run = os.path.join(work, name, "run")
    shm = tempfile.mkdtemp(prefix="moeckpt-gpu-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    events = os.path.join(work, name, "agent.jsonl")
    os.makedirs(os.path.dirname(run), exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "moeckpt.cli.main",
        "train",
        "--model",
        args.model,
        "--run-dir",
        run,
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--global-batch",
        str(args.batch),
        "--seq-len",
        str(args.seq),
        "--dtype",
        args.dtype,
        "--warmup-steps",
        "3",
        "--seed",
        "7",
        "--log-every",
        "5",
        "--inject",
        f"kill:rank=0,step={args.kill_at}",
        "--max-restarts",
        "1",
        *(["--inject", f"slow:step=1,seconds={args.slow}"] if args.slow else []),
        # one node of an elastic job of one node: torchrun's agent restarts the killed worker
        "--nproc",
        "1",
        "--nnodes",
        "1:1",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-conf",
        "last_call_timeout=1,join_timeout=60",
    ]
    if memory:
        cmd += ["--memory-tier", "--memory-every", "1", "--memory-dir", shm]
    if args.cpu:
        cmd += ["--cpu"]
    print("$", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, MOECKPT_AGENT_EVENTS=events)
    t0 = time.time()
    code = subprocess.run(cmd, env=env, check=False).returncode
    wall = time.time() - t0
    shutil.rmtree(shm, ignore_errors=True)
    rows = _rows(run)
    marker = glob.glob(os.path.join(run, ".fault-kill-*"))
    with open(marker[0]) as f:
        kill = float(f.read().strip())
    steps = [r for r in rows if "loss" in r]
    resume = next((r for r in rows if r.get("event") == "resume" and r["time"] > kill), {})
    phases = next((r for r in rows if r.get("event") == "restart_phases" and r["time"] > kill), {})
    first = min((r["time"] for r in steps if r["time"] > kill), default=None)
    trained = max((r["step"] for r in steps if r["time"] <= kill), default=0)
    agent = []
    if os.path.exists(events):
        with open(events) as f:
            agent = [json.loads(line) for line in f if line.strip()]
    detected = min((e["time"] for e in agent if e["time"] >= kill), default=None)
    timeline = {"failure detected by the agent": detected, **(phases.get("marks") or {})}
    blocked = [r["save_blocked_s"] for r in steps if r.get("save_blocked_s")]
    skipped = [r["step"] for r in steps if r.get("memory_skipped")]
    return {
        "tier": name,
        "exit": code,
        "wall_s": round(wall, 2),
        "kill_step": args.kill_at,
        "resume_tier": resume.get("tier"),
        "resume_step": resume.get("step"),
        "steps_lost": None if not resume else trained - resume["step"],
        "storage_bytes_read": resume.get("storage_bytes_read"),
        "memory_bytes_read": resume.get("memory_bytes_read"),
        "state_bytes": resume.get("state_bytes"),
        "failure_to_first_step_s": None if first is None else round(first - kill, 3),
        "phases_since_kill_s": {k: round(v - kill, 3) for k, v in timeline.items() if v},
        "phase_seconds": phases.get("seconds", {}),
        "save_blocked_s": blocked,
        "memory_skipped_steps": skipped,
    }


def d2h_copy_seconds(nbytes: int, device: str, reps: int = 5) -> list[float]:
    """A bare copy of ``nbytes`` from the device into pinned host memory (the floor of a snapshot)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device != "cpu")
    dst.copy_(src, non_blocking=True)  # a first copy faults the pages in, as the trainer's reused buffers are
    if device != "cpu":
        torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        if device != "cpu":
            torch.cuda.synchronize()
        out.append(round(time.perf_counter() - t0, 5))
    return out


#: each mark of a restart's timeline, and the phase that ends at it.
PHASE_NAMES = {
    "failure detected by the agent": "failure detection",
    "process_start": "agent teardown, rendezvous, spawn",
    "entered": "interpreter and imports",
    "world_joined": "device and process-group init",
    "model_built": "model build",
    "loaded": "load",
    "first_step": "first step",
}


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3.2))
    for row, r in enumerate(doc["runs"]):
        prev = 0.0
        for name, t in sorted(r["phases_since_kill_s"].items(), key=lambda kv: kv[1]):
            j = list(PHASE_NAMES).index(name)
            ax.barh(row, t - prev, left=prev, color=f"C{j}", edgecolor="white", label=PHASE_NAMES[name])
            prev = t
        ax.text(
            prev + 0.1,
            row,
            f"{r['failure_to_first_step_s']} s, {r['steps_lost']} step(s) lost",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(doc["runs"])), [r["tier"] for r in doc["runs"]])
    ax.set_xlabel("seconds since the worker was killed")
    ax.set_title(f"{doc['model']}: a killed worker restarted by its agent, kill to first new step by phase")
    ax.set_xlim(0, max(max(r["phases_since_kill_s"].values(), default=1) for r in doc["runs"]) * 1.35)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        dict(zip(labels, handles)).values(),
        dict(zip(labels, handles)).keys(),
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks/gpu")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "moeckpt-memory-tier-gpu"))
    ap.add_argument("--model", default="zaya-small")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--kill-at", type=int, default=47)
    ap.add_argument("--save-every", type=int, default=30)
    ap.add_argument(
        "--slow",
        type=float,
        default=0.15,
        help="seconds of straggler delay per step (the GPU drill's), so a step is not all GPU time",
    )
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (a small test of this script)")
    args = ap.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no GPU visible: nothing measured (pass --cpu for a small CPU run of this script)")
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    runs = [one_run(args, args.dir, memory) for memory in (True, False)]
    for r in runs:
        print(json.dumps(r), flush=True)
    state = runs[0]["state_bytes"] or 0
    copy = d2h_copy_seconds(state, "cpu" if args.cpu else "cuda") if state else []
    blocked = runs[0]["save_blocked_s"]
    doc = {
        "command": "python benchmarks/memory_tier_gpu.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "runs": runs,
        "d2h_copy_s": copy,
        "memory_save_blocked_median_s": statistics.median(blocked) if blocked else None,
        "blocked_over_copy": round(statistics.median(blocked) / statistics.median(copy), 3)
        if blocked and copy and statistics.median(copy) > 0
        else None,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_tier_gpu.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(args.out, "memory_tier_gpu.png"))
    print(
        f"memory save blocked (median) {doc['memory_save_blocked_median_s']} s, bare copy {copy} s, "
        f"ratio {doc['blocked_over_copy']}"
    )
    print(f"wrote {args.out}/memory_tier_gpu.json and memory_tier_gpu.png")


if __name__ == "__main__":
    main()
