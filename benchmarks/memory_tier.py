"""Issue 16 on CPU: the in-memory checkpoint tier against the persistent tiers, side by side in one run.

1. Resume: the same checkpoint (a ~24 MB zaya state) loaded by a fresh trainer from the memory tier (/dev/shm),
   from local disk with a warm page cache, from local disk with the page cache dropped, and from S3 (a moto server
   in its own process), the tiers interleaved in every repetition; each repetition reported.
2. The elastic drill (2 local nodes x 2 workers, zaya-tiny, a persistent save every 5 steps), node B killed at
   step 17: with the memory tier (a memory checkpoint every step, each node its own memory directory, B's
   deleted with it; ``--drill-reps`` times), without it, and with the memory tier as the drill restarted before
   its restart was cut (a 3 s last call, torch's 1 s rendezvous poll, workers started as new interpreters); for
   each, the steps lost, the time from the kill to the first resumed step with its phases (the agent's failure
   record, its teardown and rendezvous, the worker's process start, imports, process-group init, model build,
   load, first step) and the bytes the resume read from storage (0 from memory).

Writes ``OUT/memory_tier.json`` and ``OUT/memory_tier.png`` (resume times; the restart timelines).

Usage: ``python benchmarks/memory_tier.py --out docs/benchmarks`` (about 8 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storage import BUCKET, drop_from_page_cache, start_moto  # benchmarks/ is on sys.path from here on


def bench_model(path: str) -> str:
    """zaya-tiny widened to about 24 MB of training state (weights and AdamW moments): moto serves S3 at a few
    MB/s, so a larger state would only make this benchmark long."""
    from moeckpt.trainer.models import ModelSpec, resolve_model

    tiny = resolve_model("zaya-tiny")
    cfg = dataclasses.replace(
        tiny.config,
        hidden_size=128,
        num_hidden_layers=4,
        moe_intermediate_size=128,
        num_experts=8,
        head_dim=32,
        router_hidden_size=32,
    )
    with open(path, "w") as f:
        json.dump(ModelSpec(tiny.arch, cfg).to_json(), f)
    return path


def resume_side_by_side(work: str, reps: int) -> dict:
    from moeckpt.trainer.train import TrainConfig, Trainer

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.train_workers import memory_run

    torch.set_num_threads(1)
    model = bench_model(os.path.join(work, "model.json"))
    base = {"model": model, "steps": 10, "seq_len": 32, "global_batch": 4, "warmup_steps": 2, "cpu": True}
    local = TrainConfig(run_dir=os.path.join(work, "run"), **base)
    shm = tempfile.mkdtemp(prefix="moeckpt-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    memory = TrainConfig(run_dir=local.run_dir, memory_tier=True, memory_dir=shm, **base)
    moto, _ = start_moto()
    try:
        s3 = TrainConfig(run_dir=f"s3://{BUCKET}/memory-tier/run", **base)
        memory_run(0, memory.to_json(), 2, (2,), (2,))  # step 2 on local disk and in memory
        memory_run(0, s3.to_json(), 2, (2,), ())  # and on S3
        tiers = {"memory": memory, "disk (warm cache)": local, "disk (cache dropped)": local, "s3 (moto)": s3}
        out: dict = {name: [] for name in tiers}
        for rep in range(reps):
            names = list(tiers)
            names = names[rep % len(names) :] + names[: rep % len(names)]  # rotate: no tier always goes first
            for name in names:
                if name == "disk (cache dropped)":
                    drop_from_page_cache(local.run_dir)
                trainer = Trainer(tiers[name])
                try:
                    st = trainer.resume_stats
                    out[name].append(
                        {
                            "load_s": round(trainer.marks["loaded"] - trainer.marks["model_built"], 4),
                            "bytes_read": st.bytes_read,
                            "tier": trainer.resume_tier,
                            "step": trainer.step,
                        }
                    )
                finally:
                    trainer.close()
                print(
                    f"rep {rep} {name:22s} load {out[name][-1]['load_s']:.3f} s  "
                    f"({out[name][-1]['tier']}, {st.bytes_read / 1e6:.1f} MB)",
                    flush=True,
                )
    finally:
        moto.stop()
        shutil.rmtree(shm, ignore_errors=True)
    return {"state_mb": round(out["memory"][0]["bytes_read"] / 1e6, 1), "reps": out}


#: the drill as it was before its restart was cut: a 3 s last call, torch's 1 s look at the rendezvous state, and
#: each worker started as a new interpreter that imports torch (``MOECKPT_AGENT_FORKSERVER=0``).
BEFORE_RDZV = "join_timeout=300,last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"


def drill(work: str, memory: bool, rdzv_conf: str | None = None, *, warm: bool = True) -> dict:
    from moeckpt.trainer.elastic_drill import (
        CPU_DRILL_KILL_AT,
        DRILL_RDZV_CONF,
        cpu_drill_args,
        run_shrink_grow_drill,
    )

    conf = rdzv_conf or DRILL_RDZV_CONF
    root = os.path.join(work, f"drill-{'memory' if memory else 'storage'}-{'before' if rdzv_conf else 'default'}")
    shutil.rmtree(root, ignore_errors=True)
    run, mem = os.path.join(root, "run"), os.path.join(root, "memory")
    os.makedirs(root)
    events = {n: os.path.join(root, f"agent-{n}.jsonl") for n in "ABC"}
    result = run_shrink_grow_drill(
        run,
        cpu_drill_args(run),
        nproc=2,
        kill_at_step=CPU_DRILL_KILL_AT,
        timeout_s=600,
        memory_root=mem if memory else None,
        node_env=lambda n: {"MOECKPT_AGENT_EVENTS": events[n], **({} if warm else {"MOECKPT_AGENT_FORKSERVER": "0"})},
        progress=lambda line: print(line, flush=True),
        rdzv_conf=conf,
    )
    kill_rel = next(t for t, what in result.timeline if what.startswith("killed node B"))
    kill = result.started_at + kill_rel
    shrink = result.shrink_resume() or {}
    phases_event = next((e for e in result.events() if e.get("event") == "restart_phases" and e["time"] > kill), {})
    first_step = min((r["time"] for r in result.steps() if r["time"] > kill and r["world"] == 2), default=None)
    agent = []
    if os.path.exists(events["A"]):
        with open(events["A"]) as f:
            agent = [json.loads(line) for line in f if line.strip()]

    def first(what: str) -> float | None:
        return min((e["time"] for e in agent if e["time"] > kill and e["what"] == what), default=None)

    marks = phases_event.get("marks", {})
    timeline = [
        ("failure detected by the agent", first("worker_failed")),
        ("old workers stopped", first("workers_stopped")),
        ("rendezvous done", first("rendezvous_done")),
    ]
    timeline += [(k, v) for k, v in marks.items() if v]
    return {
        "memory_tier": memory,
        "rdzv_conf": conf,
        "warm_workers": warm,
        "exit_codes": result.exit_codes,
        "worlds": result.worlds(),
        "kill_step": result.kill_step(),
        "resume_tier": shrink.get("tier"),
        "resume_step": shrink.get("step"),
        "steps_lost": result.steps_lost(),
        "storage_bytes_read": shrink.get("storage_bytes_read", shrink.get("bytes_read")),
        "memory_bytes_read": shrink.get("memory_bytes_read", 0),
        "failure_to_first_step_s": None if first_step is None else round(first_step - kill, 3),
        "phases_since_kill_s": {name: round(t - kill, 3) for name, t in timeline if t is not None},
        "phase_seconds": phases_event.get("seconds", {}),
        "agent_events": [{**e, "since_kill_s": round(e["time"] - kill, 3)} for e in agent],
    }


def _label(d: dict) -> str:
    tier = "memory tier" if d["memory_tier"] else "storage only"
    conf = dict(item.split("=", 1) for item in d["rdzv_conf"].split(",") if "=" in item)
    last_call = conf.get("restart_last_call_timeout", conf.get("last_call_timeout"))
    start = "forked workers" if d.get("warm_workers", False) else "new interpreters"
    return f"{tier}, restart last call {last_call} s, poll {conf.get('poll_interval', '1')} s, {start}"


#: each mark of a restart's timeline, and the phase that ends at it.
PHASE_NAMES = {
    "failure detected by the agent": "failure detection",
    "old workers stopped": "agent teardown",
    "rendezvous done": "rendezvous",
    "process_start": "worker start (spawn or fork)",
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

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    reps = doc["resume"]["reps"]
    for i, rows in enumerate(reps.values()):
        ys = [r["load_s"] for r in rows]
        a.scatter([i] * len(ys), ys, s=18, color=f"C{i}")
        a.hlines(sorted(ys)[len(ys) // 2], i - 0.3, i + 0.3, color=f"C{i}")
    a.set_xticks(range(len(reps)), list(reps), rotation=15, fontsize=8)
    a.set_ylabel("load at resume (s)")
    a.set_title(f"resume of {doc['resume']['state_mb']} MB, every repetition")
    for row, d in enumerate(doc["drills"]):
        prev = 0.0
        # in the phases' order (a process start read from /proc has 10 ms resolution: it can precede the
        # agent's record of the rendezvous that started it by a few ms)
        for name, t in sorted(d["phases_since_kill_s"].items(), key=lambda kv: list(PHASE_NAMES).index(kv[0])):
            j = list(PHASE_NAMES).index(name)
            b.barh(row, max(0.0, t - prev), left=prev, color=f"C{j}", edgecolor="white", label=PHASE_NAMES[name])
            prev = max(prev, t)
        b.text(
            prev + 0.05,
            row,
            f"{d['failure_to_first_step_s']} s, {d['steps_lost']} step(s) lost",
            va="center",
            fontsize=8,
        )
    b.set_yticks(range(len(doc["drills"])), [_label(d).replace(", ", "\n") for d in doc["drills"]], fontsize=7)
    b.set_xlabel("seconds since node B was killed")
    b.set_title("drill: kill to first resumed step, by phase")
    b.set_xlim(0, max((max(d["phases_since_kill_s"].values(), default=1) for d in doc["drills"]), default=1) * 1.35)
    handles, labels = b.get_legend_handles_labels()
    b.legend(
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
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "moeckpt-memory-tier"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--drill-reps", type=int, default=3, help="repetitions of the drill with the memory tier")
    ap.add_argument("--no-drill", action="store_true", help="only the side-by-side resume")
    ap.add_argument("--replot", action="store_true", help="only redraw OUT/memory_tier.png from its JSON")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "memory_tier.json")) as f:
            plot(json.load(f), os.path.join(args.out, "memory_tier.png"))
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    doc = {
        "command": "python benchmarks/memory_tier.py " + " ".join(sys.argv[1:]),
        "cores": os.cpu_count(),
        "resume": resume_side_by_side(args.dir, args.reps),
        "drills": [],
    }
    if not args.no_drill:
        variants = [(True, None, True)] * args.drill_reps + [(False, None, True), (True, BEFORE_RDZV, False)]
        for memory, conf, warm in variants:
            doc["drills"].append(drill(args.dir, memory, conf, warm=warm))
            print(json.dumps({k: v for k, v in doc["drills"][-1].items() if k != "agent_events"}), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "memory_tier.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(args.out, "memory_tier.png"))
    print(f"wrote {args.out}/memory_tier.json and memory_tier.png")


if __name__ == "__main__":
    main()
