"""Planning at scale: a ZAYA1-8B checkpoint saved on 1,024 ranks, planned for another 1,024-rank layout.

No data and no processes: the index is built from the model's plan (one file entry per writer, as a real save
writes), then the pure planners run, side by side in one process: today's and the one before issue 21 (kept in
``tests/planner_reference.py``), on the offline plan of every target writer and on the collective load of a
group of all 1,024 ranks planned whole (every member's load plan, then the exchange plan of
``group_plan.plan_exchange``: units, owners, rounds), which is what every member of a collective load computed
before :mod:`moeckpt.reshard.rank_exchange`.

Beside them, what one member of that group computes now (``per_rank``): its own load plan and summary, the
group's decisions from every member's summary, and its own part of the exchange plan. The all_gather of the
summaries is simulated: every member's summary is computed first, untimed, in this process (what the all_gather
would deliver: ``per_rank.gathered_bytes``); then each measured member's planning is timed from them, with the
placement cache of other ranks' boxes emptied first (a member has only planned itself). Every repetition is
reported, wall and CPU time (the development machine is shared; CPU time is what the planner costs). Writes
``plan_scale.json`` and ``plan_scale.png`` under ``--out``.

    python benchmarks/plan_scale.py --out docs/benchmarks --reps 3 --ref-reps 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import sys
import time

from moeckpt.formats.index import FileEntry, Index
from moeckpt.reshard import placement
from moeckpt.reshard.group_plan import plan_exchange
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.planner import plan_load, plan_reshard
from moeckpt.reshard.rank_exchange import decide, rank_exchange, summarize
from moeckpt.reshard.source_lookup import SourcePositions
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.models import presets

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import planner_reference as reference


def build_index(preset: str, layout: Layout) -> Index:
    """The index a save of ``preset`` (bf16 parameters, fp32 master and AdamW moments) in ``layout`` writes."""
    spec = presets()[preset]
    tensors = logical_tensors(spec.param_specs(), param_dtype="bfloat16", with_optimizer=True)
    files = {
        f"rank-{r:05d}.safetensors": FileEntry(path=f"rank-{r:05d}.safetensors", size=8, checksum="xxh3_64:" + "0" * 16)
        for r in range(layout.world)
    }
    return Index(
        backend="safetensors", step=1, layout=layout.to_json(), model=spec.to_json(), tensors=tensors, files=files
    )


def timed(fn):
    """(value, wall seconds, CPU seconds); the value is freed by the caller, outside the timing."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, round(time.perf_counter() - wall, 3), round(time.process_time() - cpu, 3)


def collective(planner, index: Index, target: Layout, options: LoadOptions):
    """What one member of a collective load over all ranks plans: every member's load, then the exchange."""

    def run():
        plan = planner["load"](index, target, range(target.world))
        return plan, planner["exchange"](index, plan, options.chunk_bytes, options.round_bytes)

    return run


def per_rank(index: Index, target: Layout, options: LoadOptions, ranks: list[int], reps: int) -> dict:
    """One member's planning of a collective load over all ranks of ``target``, from every member's summary (the
    all_gather simulated: the summaries are computed first, untimed), for each of ``ranks``, ``reps`` times."""
    positions = SourcePositions(index)
    whole = plan_load(index, target, range(target.world))
    summaries = [summarize(index, r, options.chunk_bytes, positions) for r in whole.ranks]
    gathered = [(s.ids, s.nbytes, s.tags) for s in summaries]
    del whole, summaries
    peers = list(range(target.world))
    rows = []
    for rank in ranks:
        for rep in range(reps):
            placement._RANK_CACHE.clear()  # this member has planned only itself
            parts: dict = {}

            def run(rank=rank, parts=parts):
                t0 = time.process_time()
                pos = SourcePositions(index)
                own = plan_load(index, target, [rank])
                mine = summarize(index, own.ranks[0], options.chunk_bytes, pos)
                t1 = time.process_time()
                decisions = decide(gathered, options.round_bytes)
                t2 = time.process_time()
                part = rank_exchange(index, target, peers, rank, mine, decisions, options.chunk_bytes, pos)
                t3 = time.process_time()
                parts.update(
                    own_plan_and_summary_cpu_s=round(t1 - t0, 3),
                    decisions_cpu_s=round(t2 - t1, 3),
                    own_part_cpu_s=round(t3 - t2, 3),
                )
                return part

            part, wall, cpu = timed(run)
            rows.append(
                {
                    "rank": rank,
                    "rep": rep,
                    "wall_s": wall,
                    "cpu_s": cpu,
                    **parts,
                    "units_of_this_rank": len(part.units),
                    "rounds": len(part.rounds),
                    "transfers_of_this_rank": sum(len(v) for v in part.units.values()),
                }
            )
            print("per rank", rows[-1], flush=True)
            del part
    pairs = sum(len(g[0]) for g in gathered)
    return {
        "simulated": "the all_gather of the members' summaries: every member's summary is computed in this process "
        "before the timing; each timed run is one member's own load plan and summary, the decisions "
        "from all summaries, and its part of the exchange plan",
        "gathered_pairs": pairs,
        "gathered_bytes": 3 * 8 * pairs,
        "runs": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--preset", default="zaya1-8b")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of today's planner")
    parser.add_argument("--ref-reps", type=int, default=1, help="repetitions of the planner before issue 21")
    parser.add_argument("--rank-reps", type=int, default=3, help="repetitions of each member's own planning")
    parser.add_argument(
        "--ranks", type=int, nargs="*", default=[0, 777, 1023], help="members whose own planning is timed"
    )
    parser.add_argument(
        "--skip-whole", action="store_true", help="time only the per-member planning (not the whole-group planners)"
    )
    parser.add_argument(
        "--offline-only", action="store_true", help="time only the offline plan of every writer (issue 36's target)"
    )
    parser.add_argument(
        "--groups",
        type=int,
        nargs="*",
        default=None,
        help="only time today's collective plan for groups of these sizes (plan_scale_groups.json)",
    )
    args = parser.parse_args()
    if args.groups:
        groups(args)
        return
    source, target = Layout(tp=1, ep=16, dp=1024), Layout(tp=2, ep=8, dp=512)
    index, build_s, _ = timed(lambda: build_index(args.preset, source))
    raw = index.dumps()
    options = LoadOptions()
    result: dict = {
        "preset": args.preset,
        "source": source.to_json(),
        "target": target.to_json(),
        "logical_tensors": len(index.tensors),
        "state_bytes": index.nbytes,
        "index_bytes": len(raw),
        "index_build_s": build_s,
        "machine": f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}",
        "command": "python " + " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    one, s, _ = timed(lambda: plan_load(index, target, [777]))
    result["load_plan_one_rank_s"] = s
    result["load_one_rank_pieces"] = len(one.ranks[0].pieces)
    result["load_one_rank_bytes"] = one.ranks[0].nbytes
    _, result["load_plan_16_ranks_s"], _ = timed(lambda: plan_load(index, target, range(0, target.world, 64)))
    planners = {
        "today": {"reshard": plan_reshard, "load": plan_load, "exchange": plan_exchange, "reps": args.reps},
        "before": {
            "reshard": reference.plan_reshard,
            "load": reference.plan_load,
            "exchange": lambda i, p, c, r: reference.plan_exchange(i, p, c, r),
            "reps": args.ref_reps,
        },
    }
    result["per_rank"] = [] if args.offline_only else per_rank(index, target, options, args.ranks, args.rank_reps)
    os.makedirs(args.out, exist_ok=True)
    save(
        result, args.out, args.offline_only
    )  # again after every repetition: a long run interrupted keeps what it measured
    runs: dict = {}
    result["runs"] = runs
    for name, planner in ({} if args.skip_whole else planners).items():
        rows = runs[name] = {"offline_all_writers": [], "collective_1024": [], "collective_load_plans": []}
        for rep in range(planner["reps"]):
            plan, wall, cpu = timed(lambda p=planner: p["reshard"](index, target))
            rows["offline_all_writers"].append({"wall_s": wall, "cpu_s": cpu})
            result["offline_target_pieces"] = sum(len(r.pieces) for r in plan.ranks)
            del plan
            if args.offline_only:
                print(f"{name} {rep} offline_all_writers {rows['offline_all_writers'][-1]}", flush=True)
                continue
            (plan, exchange), wall, cpu = timed(collective(planner, index, target, options))
            rows["collective_1024"].append({"wall_s": wall, "cpu_s": cpu})
            result["load_all_ranks_pieces"] = sum(len(r.pieces) for r in plan.ranks)
            units = exchange.units if hasattr(exchange, "units") else exchange[0]
            result["collective_units"] = len(units)
            result["collective_transfers"] = sum(len(v) for v in units.values())
            del plan, exchange, units
            _, wall, cpu = timed(lambda p=planner: p["load"](index, target, range(target.world)))
            rows["collective_load_plans"].append({"wall_s": wall, "cpu_s": cpu})
            print(name, rep, {k: v[-1] for k, v in rows.items()}, flush=True)
            save(result, args.out, args.offline_only)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    save(result, args.out, args.offline_only)
    if runs and not args.offline_only:
        plot(runs, result["per_rank"]["runs"], os.path.join(args.out, "plan_scale.png"))
    print(json.dumps(result, indent=1))


def save(result: dict, out: str, offline_only: bool = False) -> None:
    with open(os.path.join(out, "plan_scale_offline.json" if offline_only else "plan_scale.json"), "w") as f:
        json.dump(result, f, indent=1)


def groups(args) -> None:
    """Today's collective load plan for a group of the first ``n`` ranks of the target layout (``peers``), for
    each ``n`` of ``--groups``, ``--reps`` times: what a group of that size plans on each member."""
    source, target = Layout(tp=1, ep=16, dp=1024), Layout(tp=2, ep=8, dp=512)
    index = build_index(args.preset, source)
    options = LoadOptions()
    rows = []
    for n in args.groups:
        for rep in range(args.reps):

            def run(n=n):
                plan = plan_load(index, target, range(n))
                return plan_exchange(index, plan, options.chunk_bytes, options.round_bytes)

            _, wall, cpu = timed(run)
            rows.append({"group": n, "rep": rep, "wall_s": wall, "cpu_s": cpu})
            print(rows[-1], flush=True)
    result = {
        "preset": args.preset,
        "source": source.to_json(),
        "target": target.to_json(),
        "runs": rows,
        "command": "python " + " ".join(sys.argv),
        "machine": f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_scale_groups.json"), "w") as f:
        json.dump(result, f, indent=1)


def plot(runs: dict, members: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measures = [
        ("offline_all_writers", "offline plan,\nall 1,024 writers"),
        ("collective_1024", "collective load plan,\nall 1,024 members"),
        ("collective_load_plans", "of which: every\nmember's load plan"),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, (name, colour) in enumerate([("before", "tab:gray"), ("today", "tab:blue")]):
        for i, (key, _) in enumerate(measures):
            cpu = [r["cpu_s"] for r in runs.get(name, {}).get(key, [])]
            if not cpu:  # a planner not run (--ref-reps 0, say) has no bar
                continue
            x = i + (j - 0.5) * 0.35
            ax.bar(x, sorted(cpu)[len(cpu) // 2], 0.33, color=colour, label=name if i == 0 else None)
            ax.scatter([x] * len(cpu), cpu, color="black", s=10, zorder=3)
    cpu = [r["cpu_s"] for r in members]
    if cpu:  # no members timed (--ranks with none, or --rank-reps 0): no bar
        x = len(measures)
        ax.bar(x, sorted(cpu)[len(cpu) // 2], 0.33, color="tab:green", label="one member, from the summaries")
        ax.scatter([x] * len(cpu), cpu, color="black", s=10, zorder=3)
    ax.axhline(5, color="tab:red", linestyle="--", linewidth=1, label="target 5 s")
    ax.set_xticks(range(len(measures) + 1), [m[1] for m in measures] + ["collective load plan,\none member (new)"])
    ax.set_ylabel("CPU seconds (median bar, every repetition a dot)")
    ax.set_yscale("log")
    ax.set_title("zaya1-8b, tp1 ep16 dp1024 -> tp2 ep8 dp512: planning on one core")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
