"""The memory tier on one GPU: a worker killed at several steps of one run, restarted each time by its torchrun agent.

Two runs side by side, the same model and faults (``--inject kill:rank=0,step=K`` for every K of ``--kill-at``,
each firing once, between persistent saves and right after one): with ``--memory-tier --memory-every N`` and
without. For each kill: the tier and step the restarted worker resumed from, the steps lost, the time from the kill
to its first new step with the phases (the agent's failure record, process start, imports, device and
process-group init, model build, load, first step), the time every save blocked training since the kill before,
the first save after the restart, the memory saves left out and the memory interval the run kept; for the memory
run every save's blocked time (and where the training thread waited: the state gathered, the in-flight question,
the copy itself) against a bare device-to-host copy of the same bytes into pinned memory, and when each memory
checkpoint committed after its copy (seconds, and steps ended in between). A per-kill table and a per-save table
are printed and written.

Writes ``OUT/memory_tier_gpu.json``, ``OUT/memory_tier_gpu.png``, ``OUT/memory_tier_gpu_kills.md`` and
``OUT/memory_tier_gpu_saves.md``.

Usage (one H200): ``python benchmarks/memory_tier_gpu.py --out docs/benchmarks/gpu`` (zaya-small, bf16; a few
minutes). Without a GPU it exits 0 saying so, unless ``--cpu`` (a small CPU run for testing:
``python benchmarks/memory_tier_gpu.py --cpu --model zaya-tiny --steps 20 --kill-at 5,7,10,13,16 --save-every 0
--memory-every 2 --nproc 2 --batch 4 --seq 32 --dtype fp32 --slow 0 --no-storage-run --out /tmp/mt-gpu``).
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
    """One run killed at every step of ``args.kills`` (each kill fires once; the agent restarts the worker), the
    memory tier on or off; a row per kill."""
    name = "memory" if memory else "storage"
    run = os.path.join(work, name, "run")
    shm = tempfile.mkdtemp(prefix="moeckpt-gpu-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    events = os.path.join(work, name, "agent.jsonl")
    os.makedirs(os.path.dirname(run), exist_ok=True)
    kills = [arg for k in args.kills for arg in ("--inject", f"kill:rank=0,step={k}")]
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
        "--keep-last",
        str(args.keep_last),
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
        *kills,
        "--max-restarts",
        str(len(args.kills)),
        *(["--inject", f"slow:step=1,seconds={args.slow}"] if args.slow else []),
        # one node of an elastic job of one node: torchrun's agent restarts the killed worker
        "--nproc",
        str(args.nproc),
        "--nnodes",
        "1:1",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--rdzv-conf",
        "last_call_timeout=1,join_timeout=60",
    ]
    if memory:
        cmd += ["--memory-tier", "--memory-every", str(args.memory_every), "--memory-dir", shm]
        cmd += ["--memory-keep", str(args.memory_keep)]
    if args.cpu:
        cmd += ["--cpu"]
    print("$", " ".join(cmd[2:]), flush=True)
    env = dict(os.environ, MOECKPT_AGENT_EVENTS=events, MOECKPT_MEMORY_RING="1" if args.ring else "0")
    t0 = time.time()
    code = subprocess.run(cmd, env=env, check=False).returncode
    wall = time.time() - t0
    shutil.rmtree(shm, ignore_errors=True)
    rows = _rows(run)
    times = {}
    for marker in glob.glob(os.path.join(run, ".fault-kill-*")):
        with open(marker) as f:
            times[int(marker.rsplit("step", 1)[1])] = float(f.read().strip())
    agent = []
    if os.path.exists(events):
        with open(events) as f:
            agent = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "loss" in r]
    out = []
    order = sorted(times.items(), key=lambda kv: kv[1])
    for i, (kill_step, kill) in enumerate(order):
        since = order[i - 1][1] if i else float("-inf")
        until = order[i + 1][1] if i + 1 < len(order) else float("inf")
        resume = next((r for r in rows if r.get("event") == "resume" and kill < r["time"] < until), {})
        phases = next((r for r in rows if r.get("event") == "restart_phases" and kill < r["time"] < until), {})
        first = min((r["time"] for r in steps if kill < r["time"] < until), default=None)
        trained = max((r["step"] for r in steps if since < r["time"] <= kill), default=0)
        detected = min((e["time"] for e in agent if e["time"] >= kill), default=None)
        timeline = {"failure detected by the agent": detected, **(phases.get("marks") or {})}
        blocked = [
            (r["step"], r["save_blocked_s"]) for r in steps if since < r["time"] <= kill and "save_blocked_s" in r
        ]
        after = [r["save_blocked_s"] for r in steps if kill < r["time"] < until and "save_blocked_s" in r]
        out.append(
            {
                "tier": name,
                "kill_step": kill_step,
                "trained_before_kill": trained,
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
                "first_save_after_restart_blocked_s": after[0] if after else None,
                "memory_skipped_steps": [
                    r["step"] for r in steps if since < r["time"] <= kill and r.get("memory_skipped")
                ],
                "memory_every": [r["memory_every"] for r in steps if since < r["time"] <= kill and "memory_every" in r],
                "newest_memory_save": max(
                    (r["step"] for r in steps if since < r["time"] <= kill and (r.get("save") or {}).get("memory")),
                    default=None,
                ),
            }
        )
    return {
        "tier": name,
        "exit": code,
        "wall_s": round(wall, 2),
        "kills": out,
        "saves": saves(rows),
        "pace": [r for r in rows if r.get("event") == "memory_pace"],
    }


def saves(rows: list[dict]) -> list[dict]:
    """Every save of a run's metrics (rank 0's): where the training thread waited, the bytes, and for a memory
    save when it committed, in seconds after its copy and in steps (steps that ended between the copy and the
    commit: 0 is within the step after the copy)."""
    steps = [r for r in rows if "loss" in r]
    commits = {}
    for r in rows:
        if r.get("event") == "memory_commit":
            commits[(r["step"], r["copied_at"])] = r
    out = []
    for r in steps:
        save = r.get("save")
        if not save:
            continue
        # the commit of this save: of its step, copied after this step ended and before the next one did
        until = min((x["time"] for x in steps if x["time"] > r["time"]), default=float("inf"))
        commit = next(
            (c for (st, at), c in commits.items() if st == r["step"] and r["time"] <= at < until),
            None,
        )
        row = {"step": r["step"], "time": r["time"], **save}
        if commit is not None:
            row["commit_after_copy_s"] = commit["after_copy_s"]
            row["commit_after_steps"] = sum(
                1 for x in steps if commit["copied_at"] < x["time"] <= commit["committed_at"]
            )
        out.append(row)
    return out


def saves_table(doc: dict) -> str:
    """The memory run's saves (markdown): blocked time, its parts, and blocked over a bare copy of the same bytes."""
    copy = statistics.median(doc["d2h_copy_s"]) if doc.get("d2h_copy_s") else None
    lines = [
        "| step | to memory | skipped | blocked (s) | copy (s) | state gathered (s) | in-flight question (s) | bytes "
        "| blocked / bare copy | commit after copy (s) | steps ended before commit | slot pinned (still pinning) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["runs"][0].get("saves", []):
        ratio = round(r["blocked_s"] / copy, 2) if copy and not r["skipped"] else None
        lines.append(
            f"| {r['step']} | {r['memory']} | {r['skipped']} | {r['blocked_s']:.4f} | {r['copy_s']:.4f} | "
            f"{r['state_s']:.4f} | {r['decide_s']:.4f} | {r['bytes']} | {ratio} | "
            f"{r.get('commit_after_copy_s')} | {r.get('commit_after_steps')} | "
            f"{r.get('ring_pinned')} ({r.get('ring_pinning')}) |"
        )
    return "\n".join(lines) + "\n"


def table(doc: dict) -> str:
    """The per-kill table (markdown)."""
    lines = [
        "| run | kill at step | trained | resumed from | steps lost | kill to first step (s) | saves blocked max (s) "
        "| first save after restart (s) | memory saves left out | newest memory save before the kill "
        "| memory interval (steps) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["runs"]:
        for k in r["kills"]:
            worst = max((b for _, b in k["save_blocked_s"]), default=None)
            lines.append(
                f"| {r['tier']} | {k['kill_step']} | {k['trained_before_kill']} | {k['resume_tier']} step "
                f"{k['resume_step']} | {k['steps_lost']} | {k['failure_to_first_step_s']} | {worst} | "
                f"{k['first_save_after_restart_blocked_s']} | {len(k['memory_skipped_steps'])} | "
                f"{k.get('newest_memory_save')} | {_span(k.get('memory_every') or [])} |"
            )
    return "\n".join(lines) + "\n"


def _span(values: list[int]) -> str:
    return "" if not values else str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


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

    rows = [{**k, "tier": f"{r['tier']} kill@{k['kill_step']}"} for r in doc["runs"] for k in r["kills"]]
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.4 * len(rows)))
    for row, r in enumerate(rows):
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
    ax.set_yticks(range(len(rows)), [r["tier"] for r in rows])
    ax.set_xlabel("seconds since the worker was killed")
    ax.set_title(f"{doc['model']}: a killed worker restarted by its agent, kill to first new step by phase")
    ax.set_xlim(0, max((max(r["phases_since_kill_s"].values(), default=1) for r in rows), default=1) * 1.35)
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
    ap.add_argument("--steps", type=int, default=66)
    ap.add_argument(
        "--kill-at",
        default="31,37,44,47,55,61",
        help="the steps the worker is killed at, comma-separated (each once, in one invocation)",
    )
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument(
        "--ring", action=argparse.BooleanOptionalAction, default=True, help="the memory ring ($MOECKPT_MEMORY_RING)"
    )
    ap.add_argument("--memory-every", type=int, default=1)
    ap.add_argument("--storage-run", action=argparse.BooleanOptionalAction, default=True, help="the run beside it")
    ap.add_argument("--save-every", type=int, default=30)
    ap.add_argument(
        "--keep-last", type=int, default=3, help="persistent checkpoints kept (a large state: mind the disk)"
    )
    ap.add_argument("--memory-keep", type=int, default=2, help="memory checkpoints kept (the ring has one slot more)")
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
    ap.add_argument("--report", metavar="JSON", help="only write the tables, plot and summary of an earlier run's JSON")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            doc = json.load(f)
        if "steps" not in doc:  # runs before the field: the --steps of their command
            argv = doc["command"].split()
            doc["steps"] = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 66
        write_report(doc, args.out)
        return
    args.kills = sorted({int(k) for k in str(args.kill_at).split(",") if k.strip()})
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no GPU visible: nothing measured (pass --cpu for a small CPU run of this script)")
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    runs = [one_run(args, args.dir, memory) for memory in ((True, False) if args.storage_run else (True,))]
    for r in runs:
        print(json.dumps(r), flush=True)
    # the bare copy of the bytes rank 0's saves copy (its written share: the whole state on one rank)
    sizes = [r["bytes"] for r in runs[0]["saves"] if r["bytes"]]
    state = (
        statistics.median(sizes) if sizes else next((k["state_bytes"] for k in runs[0]["kills"] if k["state_bytes"]), 0)
    )
    copy = d2h_copy_seconds(int(state), "cpu" if args.cpu else "cuda") if state else []
    doc = {
        "command": "python benchmarks/memory_tier_gpu.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
        "steps": args.steps,
        "runs": runs,
        "d2h_copy_s": copy,
    }
    write_report(doc, args.out)


def summarise(doc: dict) -> None:
    """The memory run's blocked times against the bare copy: over every save, and over the saves made while
    training (all but the end-of-run save at the last step, whose wait for the persistent write before it blocks
    no step: training is over)."""
    copy = doc["d2h_copy_s"]
    saves = [r for r in doc["runs"][0]["saves"] if not r["skipped"]]
    blocked = [r["blocked_s"] for r in saves]
    training = [r["blocked_s"] for r in saves if r["step"] != doc.get("steps")]
    bare = statistics.median(copy) if copy else 0.0
    doc["memory_save_blocked_median_s"] = statistics.median(blocked) if blocked else None
    doc["memory_save_blocked_max_s"] = max(blocked) if blocked else None
    doc["blocked_over_copy"] = round(statistics.median(blocked) / bare, 3) if blocked and bare > 0 else None
    doc["memory_save_blocked_max_while_training_s"] = max(training) if training else None
    doc["max_blocked_over_copy_while_training"] = round(max(training) / bare, 3) if training and bare > 0 else None


def write_report(doc: dict, out: str) -> None:
    """The JSON, the plot and both tables of ``doc`` into ``out`` (also from an earlier run's JSON: --report)."""
    summarise(doc)
    copy = doc["d2h_copy_s"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "memory_tier_gpu.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(out, "memory_tier_gpu.png"))
    with open(os.path.join(out, "memory_tier_gpu_kills.md"), "w") as f:
        f.write(table(doc))
    with open(os.path.join(out, "memory_tier_gpu_saves.md"), "w") as f:
        f.write(saves_table(doc))
    print(table(doc))
    print(saves_table(doc))
    print(
        f"memory save blocked (median) {doc['memory_save_blocked_median_s']} s, bare copy {copy} s, "
        f"ratio {doc['blocked_over_copy']}; while training at most {doc['memory_save_blocked_max_while_training_s']} "
        f"s, {doc['max_blocked_over_copy_while_training']}x"
    )
    print(f"wrote {out}/memory_tier_gpu.json and memory_tier_gpu.png")


if __name__ == "__main__":
    main()
