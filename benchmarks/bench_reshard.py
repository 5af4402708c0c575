"""Reshard benchmark, side by side in one run on the same state: moeckpt vs ``cp -r`` and vs torch DCP.

The state is a ZAYA model (``zaya-small`` widened to ``--gb``) with bf16 parameters, fp32 master weights and
AdamW moments, saved once by moeckpt in the source layout and once by ``torch.distributed.checkpoint`` (DTensors
on an (edp, ep, tp) CPU mesh with the same global shapes and placements) by 4 gloo ranks. Then:

1. **offline**: ``moeckpt.reshard.executor.reshard`` (in a fresh process; its peak RSS and its largest writer
   process's are recorded) into the target layout, against ``cp -r`` of the same checkpoint directory followed by
   ``sync``; ``--reps`` pairs run back to back, page cache dropped before each, the median of each kept.
2. **load with reshard into 4 ranks**: every rank loads its state of the target layout, moeckpt over a gloo group
   exchanging replicated pieces (``exchange``: each stored byte read once) and with each rank reading its own bytes
   (``own``: what a resume does on one host with a local checkpoint, ``--resume-reads auto``), DCP with
   ``dcp.load`` into DTensors of the target sharding. Timed from a barrier to a barrier,
   page cache dropped before each; ``--load-reps`` repetitions, each starting with another method (the first call
   in a process pays one-time costs: DCP's first load took twice its later ones), the median kept; bytes read
   measured per process from ``/proc/self/io`` (``rchar``).
3. **bytes read / bytes needed at dp = 1, 4, 8** for moeckpt (exchange, own) and DCP; "needed" is the distinct
   bytes of the new layout (the logical state, each element once).
4. **offline read sweep** (a smaller state of zaya-small's widths, :func:`sweep_model`): bytes the offline
   reshard fetched over the source's stored bytes for layout pairs tp 1<->2, ep 1<->4, dp 2<->3 (uneven ZeRO
   parts), uneven dp 3, 6, 12 with a TP or EP change, and the benchmark's own pair, counted by the executor's
   chunk cache (data widened to checksum blocks), with the cache left at its default; each of ``--sweep-reps``
   repetitions beside a ``cp -r`` + ``sync`` of the same source (its time over the reshard's:
   ``speed_over_cp``, target >= 0.8); and one rank of a tp=2 target loading alone from a tp=1 checkpoint: bytes
   fetched over bytes it holds. ``--only read-sweep`` runs just this part (``reshard_read_sweep.json``).

Results: ``docs/benchmarks/reshard.json`` and ``reshard.png``.

    python benchmarks/bench_reshard.py --gb 1.07        # the full run
    python benchmarks/bench_reshard.py --gb 0.05        # a quick check
    python benchmarks/bench_reshard.py --only read-sweep
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dcp_state import dcp_state  # benchmarks/ is on sys.path when a script here runs

from moeckpt.formats import dtypes
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.collectives import all_gather_json
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.models import ModelSpec, presets

#: the 4-rank load methods: moeckpt exchanging replicated pieces, moeckpt with each rank reading its own, DCP.
LOAD_METHODS = ["exchange", "own", "dcp"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scaled_model(gb: float) -> ModelSpec:
    """``zaya-small`` widened (multiples of 16: whole heads, even TP splits) until its training state reaches ``gb``."""
    base = presets()["zaya-small"]
    for hidden in range(16, 64 * 1024, 16):
        c = replace(
            base.config,
            hidden_size=hidden,
            head_dim=hidden // base.config.num_attention_heads,
            moe_intermediate_size=hidden,
        )
        spec = ModelSpec(base.arch, c)
        if sum(e.nbytes for e in state_tensors(spec).values()) >= gb * 1e9:
            return spec
    raise ValueError(f"--gb {gb} is too large")


def state_tensors(spec: ModelSpec) -> dict[str, TensorEntry]:
    return logical_tensors(spec.param_specs(), param_dtype="bfloat16", with_optimizer=True)


def parse_layout(text: str) -> Layout:
    vals = dict(kv.split("=") for kv in text.split(","))
    return Layout(**{k: int(v) for k, v in vals.items()})


def settle() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


# -- workers --------------------------------------------------------------------------------------------------------
def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def dcp_save_worker(rank: int, world: int, port: int, gb: float, layout: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    _init(rank, world, port)
    generator = torch.Generator().manual_seed(dist.get_rank())
    state = dcp_state(state_tensors(scaled_model(gb)), Layout(**layout), generator)
    dcp.save(state, checkpoint_id=path)
    dist.barrier()
    dist.destroy_process_group()


def load_worker(
    rank: int,
    world: int,
    port: int,
    gb: float,
    layout: dict,
    src: str,
    dcp_path: str,
    methods: list,
    reps: int,
    out: str,
    profile: str | None = None,
) -> None:
    import torch.distributed.checkpoint as dcp

    _init(rank, world, port)
    target = Layout(**layout)
    tensors = state_tensors(scaled_model(gb))
    result: dict = {m: [] for m in methods}
    for rep in range(reps):
        # Each repetition starts with another method, so no method always pays the processes' first-call costs.
        for method in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            if rank == 0:
                settle()
            dist.barrier()
            before = rchar()
            t0 = time.perf_counter()
            stats = LoadStats()
            prof = None
            if method == "raw":
                state = None
                needed = raw_read(src, rank, world)
            elif method == "dcp":
                state = dcp_state(tensors, target, None)
                dcp.load(state, checkpoint_id=dcp_path)
                needed = sum(v.to_local().numel() * v.to_local().element_size() for v in state.values())
            else:
                # --profile: rank 0's last load with its own reads, under cProfile (written after the timing)
                prof = cProfile.Profile() if profile and rank == 0 and method == "own" and rep == reps - 1 else None
                if prof is not None:
                    prof.enable()
                state = load_rank_state(
                    src, target, rank, group=dist.group.WORLD, exchange=method == "exchange", stats=stats
                )
                if prof is not None:
                    prof.disable()
                needed = stats.bytes_needed
            dist.barrier()
            elapsed = time.perf_counter() - t0
            result[method].append(
                {"s": elapsed, "rchar": rchar() - before, "needed": needed, "data_read": stats.bytes_read}
            )
            del state
            if prof is not None:
                with open(profile, "w") as f:
                    f.write(f"rank 0, load with own reads, {elapsed:.3f} s (the slowest rank's time, under cProfile)\n")
                    for order in ("cumulative", "tottime"):
                        pstats.Stats(prof, stream=f).sort_stats(order).print_stats(40)
                prof = None
    gathered = all_gather_json(result)  # JSON, not pickled objects
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def raw_read(src: str, rank: int, world: int) -> int:
    """The physical limit of a load: rank ``rank`` of ``world`` processes ``pread`` s its share of the checkpoint's
    data files (the files end to end, cut in ``world`` equal byte ranges) into memory, 64 MiB per call, one
    thread. Between them the processes read every stored byte once. Returns the bytes read."""
    files = sorted(os.path.join(src, n) for n in os.listdir(src) if n.endswith(".safetensors"))
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    buf = torch.empty(hi - lo, dtype=torch.uint8)
    view = buf.numpy().data
    at = pos = 0  # at: where this file starts in the concatenation; pos: bytes of buf filled
    for path, size in zip(files, sizes):
        a, b = max(lo, at), min(hi, at + size)
        if a < b:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = a - at
                while off < b - at:
                    n = os.preadv(fd, [view[pos : pos + min(64 << 20, b - at - off)]], off)
                    if n <= 0:
                        raise OSError(f"{path}: short read")
                    off += n
                    pos += n
            finally:
                os.close(fd)
        at += size
    return pos


def run_loads(args, world: int, layout: Layout, methods: list[str], src: str, dcp_path: str, reps: int = 1) -> dict:
    """Per method: the median time over ``reps`` repetitions (each the slowest rank's), every repetition's time,
    and the bytes of the first repetition."""
    out = os.path.join(args.dir, f"load-{world}.json")
    profile = None
    if args.profile:
        os.makedirs(args.out, exist_ok=True)
        profile = os.path.join(args.out, "reshard_load_profile.txt")
    mp.spawn(
        load_worker,
        args=(world, free_port(), args.gb, layout.to_json(), src, dcp_path, methods, reps, out, profile),
        nprocs=world,
    )
    with open(out) as f:
        per_rank = json.load(f)
    summary = {}
    for m in methods:
        times = [max(r[m][i]["s"] for r in per_rank) for i in range(reps)]
        summary[m] = {
            "s": sorted(times)[len(times) // 2],
            "runs_s": [round(t, 3) for t in times],
            "bytes_read": sum(r[m][0]["rchar"] for r in per_rank),
            "sum_rank_needs": sum(r[m][0]["needed"] for r in per_rank),
            "moeckpt_data_bytes_read": sum(r[m][0]["data_read"] for r in per_rank),
        }
    return summary


# -- offline --------------------------------------------------------------------------------------------------------
OFFLINE_CHILD = """
import gc, json, sys, time
from moeckpt.reshard.executor import reshard
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import ReshardOptions
gc.collect(); gc.freeze()  # as the moeckpt command does after its imports (cli/main.py)
r = reshard(sys.argv[1], sys.argv[2], Layout(**json.loads(sys.argv[3])), options=ReshardOptions(workers=int(sys.argv[4])))
# VmHWM, not getrusage: ru_maxrss would include the parent's pages between fork and exec.
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
# The largest writer process (forked, so its figure includes pages it shares with this one).
import resource
child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"s": r.seconds, "bytes_read": r.bytes_read, "bytes_written": r.bytes_written, "peak_rss_bytes": hwm,
                  "writer_peak_rss_bytes": child}))
"""
BASELINE_CHILD = """
import torch, moeckpt.reshard.executor
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def run_offline(args, src: str, target: Layout) -> dict:
    dst, copy = os.path.join(args.dir, "offline"), os.path.join(args.dir, "copy")
    results: dict = {"cp": [], "moeckpt": []}
    for _ in range(args.reps):
        for method in ("cp", "moeckpt"):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            settle()
            if method == "cp":
                t0 = time.perf_counter()
                subprocess.run(["cp", "-r", src, copy], check=True)
                subprocess.run(["sync"], check=True)
                results["cp"].append({"s": time.perf_counter() - t0})
            else:
                t0 = time.perf_counter()
                proc = subprocess.Popen(
                    [sys.executable, "-c", OFFLINE_CHILD, src, dst, json.dumps(target.to_json()), str(args.workers)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                out, _ = proc.communicate()
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise SystemExit("offline reshard failed")
                doc = json.loads(out)
                doc.update(wall_with_startup_s=wall)
                results["moeckpt"].append(doc)
    # The median run of each (cp's own time varies 2x between runs on a shared machine).
    best = {m: sorted(results[m], key=lambda r: r["s"])[len(results[m]) // 2] for m in results}
    # What the interpreter with torch and moeckpt imported takes before any work, to read the peak RSS against.
    base = subprocess.run([sys.executable, "-c", BASELINE_CHILD], capture_output=True, text=True, check=True)
    return {"runs": results, "best": best, "baseline_rss_bytes": int(base.stdout)}


#: offline read sweep: (source, target) as (tp, ep, dp).
READ_SWEEP_PAIRS = [
    ((1, 1, 2), (2, 1, 2)),
    ((2, 1, 2), (1, 1, 2)),
    ((1, 1, 4), (1, 4, 4)),
    ((1, 4, 4), (1, 1, 4)),
    ((1, 1, 2), (1, 1, 3)),
    ((1, 1, 3), (1, 1, 2)),
    ((2, 2, 2), (1, 4, 4)),
    ((1, 1, 1), (2, 1, 1)),
    # uneven dp (3, 6, 12) together with a TP or EP change, from states with optimizer moments (issue 36 item 4)
    ((1, 2, 2), (2, 1, 3)),
    ((1, 1, 3), (2, 1, 6)),
    ((2, 2, 4), (1, 1, 3)),
    ((1, 2, 6), (2, 4, 12)),
    ((1, 1, 12), (2, 2, 6)),
]


def sweep_model() -> ModelSpec:
    """``zaya-small``'s widths (rows of 2-8 KiB, which divide the 4 MiB checksum blocks) with one layer, 4 experts
    and a 4,096-token vocabulary: 0.27 GB of training state. The widened ``--gb`` model has rows that do not
    divide the blocks, so neighbouring chunks fetch the block they straddle twice (docs/reshard.md)."""
    base = presets()["zaya-small"]
    return ModelSpec(base.arch, replace(base.config, vocab_size=4096, num_hidden_layers=1, num_experts=4))


def read_sweep(args) -> dict:
    """Offline reshards of each pair (bytes fetched / source bytes) and a tp=2 rank loading alone from tp=1."""
    from moeckpt.formats.checkpoint import CheckpointReader
    from moeckpt.reshard.executor import reshard
    from moeckpt.reshard.options import ReshardOptions

    spec = sweep_model()
    tensors = state_tensors(spec)
    payload = sum(e.nbytes for e in tensors.values())
    root = os.path.join(args.dir, "sweep")
    sources: dict[tuple, str] = {}

    def source(t: tuple) -> str:
        if t not in sources:
            path = os.path.join(root, "src-" + "-".join(map(str, t)))
            g = torch.Generator().manual_seed(0)
            save_full_tensors(
                path,
                tensors=tensors,
                layout=Layout(tp=t[0], ep=t[1], dp=t[2]),
                model=spec.to_json(),
                step=1,
                values=lambda e: torch.randn(e.shape, generator=g).to(dtypes.to_torch(e.dtype)),
            )
            sources[t] = path
        return sources[t]

    pairs = []
    for a, b in READ_SWEEP_PAIRS:
        src = source(a)
        stored = sum(r.nbytes for r in CheckpointReader(src).pieces())
        dst, copy = os.path.join(root, "dst"), os.path.join(root, "copy")
        runs = []
        for _ in range(args.sweep_reps):
            # cp -r + sync of the same checkpoint, then the reshard (which fsyncs before its commit), each after a
            # sync and with the page cache dropped where allowed: no writeback of the source just written runs
            # during either (it had made the first pair of each new source take 5-10x the others).
            shutil.rmtree(copy, ignore_errors=True)
            settle()
            t0 = time.perf_counter()
            subprocess.run(["cp", "-r", src, copy], check=True)
            subprocess.run(["sync"], check=True)
            cp_s = time.perf_counter() - t0
            shutil.rmtree(copy, ignore_errors=True)
            shutil.rmtree(dst, ignore_errors=True)
            settle()
            r = reshard(src, dst, Layout(tp=b[0], ep=b[1], dp=b[2]), options=ReshardOptions(workers=args.workers))
            runs.append({"bytes_read": r.bytes_read, "s": round(r.seconds, 3), "cp_s": round(cp_s, 3)})
            print(
                f"read sweep {a} -> {b}: {r.bytes_read / stored:.3f}x the source bytes, {r.seconds:.2f} s "
                f"(cp -r + sync {cp_s:.2f} s: {cp_s / r.seconds:.2f}x its speed)",
                flush=True,
            )
        worst = max(runs, key=lambda x: x["bytes_read"])
        pairs.append(
            {
                "source": a,
                "target": b,
                "bytes_read": worst["bytes_read"],
                "source_bytes": stored,
                "read_over_source": round(worst["bytes_read"] / stored, 4),
                "s": sorted(x["s"] for x in runs)[len(runs) // 2],
                "runs": [
                    {
                        **x,
                        "read_over_source": round(x["bytes_read"] / stored, 4),
                        "speed_over_cp": round(x["cp_s"] / x["s"], 3),
                    }
                    for x in runs
                ],
            }
        )
    stats = LoadStats()
    load_rank_state(source((1, 1, 1)), Layout(tp=2, ep=1, dp=1), 0, stats=stats)
    alone = {
        "source": (1, 1, 1),
        "target": (2, 1, 1),
        "rank": 0,
        "bytes_read": stats.bytes_read,
        "bytes_needed": stats.bytes_needed,
        "read_over_needed": round(stats.bytes_read / stats.bytes_needed, 4),
    }
    print(f"tp=2 rank 0 alone: {alone['read_over_needed']}x the bytes it holds", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    return {
        "payload_gb": round(payload / 1e9, 4),
        "workers": args.workers,
        "offline": pairs,
        "load_alone_tp2": alone,
        "target": 1.05,
        "speed_over_cp_target": 0.8,
    }


def plot_read_sweep(sweep: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.6))
    labels = [f"{p['source']}\n-> {p['target']}" for p in sweep["offline"]] + ["tp=2 rank\nalone"]
    vals = [p["read_over_source"] for p in sweep["offline"]] + [sweep["load_alone_tp2"]["read_over_needed"]]
    ax.bar(range(len(vals)), vals, color=["#1f77b4"] * len(sweep["offline"]) + ["#6baed6"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.05, color="red", lw=0.8, ls="--")
    ax.set_xticks(range(len(vals)), labels, fontsize=7)
    ax.set_ylabel("bytes read / bytes stored (needed)")
    ax.set_title(f"offline reshard reads, (tp, ep, dp) pairs, {sweep['payload_gb']:.2f} GB state", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.07, help="size of the training state (GB)")
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-reshard", help="scratch directory (local disk)")
    ap.add_argument("--source", default="tp=2,ep=2,dp=2", help="layout the checkpoints are saved in (4 ranks)")
    ap.add_argument("--target", default="tp=1,ep=4,dp=4", help="layout of the reshard and the 4-rank load")
    ap.add_argument("--sweep-dp", default="1,4,8", help="dp values of the bytes-read sweep (tp=1)")
    ap.add_argument("--workers", type=int, default=4, help="offline reshard workers")
    ap.add_argument(
        "--sweep-reps", type=int, default=2, help="repetitions of each read-sweep pair (each beside a cp -r + sync)"
    )
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the offline comparison (median kept)")
    ap.add_argument(
        "--load-reps",
        type=int,
        default=3,
        help="repetitions of the 4-rank load comparison, in rotating order (median kept)",
    )
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks"), help="where JSON and PNG go")
    ap.add_argument("--only", choices=["read-sweep", "load"], help="run only this part")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile rank 0's last 4-rank load with its own reads: OUT/reshard_load_profile.txt",
    )
    args = ap.parse_args()
    source, target = parse_layout(args.source), parse_layout(args.target)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    if args.only == "read-sweep":
        sweep = {
            "benchmark": "reshard_read_sweep",
            "command": "python benchmarks/bench_reshard.py " + " ".join(sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"nproc": os.cpu_count(), "torch": torch.__version__},
            **read_sweep(args),
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "reshard_read_sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        plot_read_sweep(sweep, os.path.join(args.out, "reshard_read_sweep.png"))
        return
    spec = scaled_model(args.gb)
    tensors = state_tensors(spec)
    payload = sum(e.nbytes for e in tensors.values())
    print(f"state: {payload / 1e9:.3f} GB, {len(tensors)} tensors; source {source}, target {target}", flush=True)

    src = os.path.join(args.dir, "moeckpt-src")
    g = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    save_full_tensors(
        src,
        tensors=tensors,
        layout=source,
        model=spec.to_json(),
        step=100,
        values=lambda e: torch.randn(e.shape, generator=g).to(dtypes.to_torch(e.dtype)),
    )
    print(f"saved moeckpt source in {time.perf_counter() - t0:.1f} s", flush=True)
    dcp_path = os.path.join(args.dir, "dcp-src")
    mp.spawn(
        dcp_save_worker, args=(source.world, free_port(), args.gb, source.to_json(), dcp_path), nprocs=source.world
    )
    print("saved DCP source", flush=True)

    if args.only != "load":
        offline = run_offline(args, src, target)
        ob = offline["best"]
        print(
            f"offline: cp {ob['cp']['s']:.2f} s, moeckpt {ob['moeckpt']['s']:.2f} s "
            f"(peak RSS {ob['moeckpt']['peak_rss_bytes'] / 1e6:.0f} MB)",
            flush=True,
        )

    load4 = run_loads(args, target.world, target, LOAD_METHODS + ["raw"], src, dcp_path, reps=args.load_reps)
    print(f"load into {target}: " + ", ".join(f"{m} {v['s']:.2f} s" for m, v in load4.items()), flush=True)
    load_summary = {
        **{f"{m}_s": round(v["s"], 3) for m, v in load4.items()},
        **{f"{m}_gb_per_s": round(payload / 1e9 / v["s"], 3) for m, v in load4.items()},
        **{f"{m}_runs_s": v["runs_s"] for m, v in load4.items()},
        "ratio_exchange_over_dcp": round(load4["dcp"]["s"] / load4["exchange"]["s"], 3),
        "ratio_own_over_dcp": round(load4["dcp"]["s"] / load4["own"]["s"], 3),
        # every repetition: DCP's time over ours, and the raw read's time over ours (the repetitions ran in turn)
        "runs_own_over_dcp": [round(d / o, 3) for d, o in zip(load4["dcp"]["runs_s"], load4["own"]["runs_s"])],
        "runs_exchange_over_dcp": [
            round(d / o, 3) for d, o in zip(load4["dcp"]["runs_s"], load4["exchange"]["runs_s"])
        ],
        "runs_own_over_raw": [round(r / o, 3) for r, o in zip(load4["raw"]["runs_s"], load4["own"]["runs_s"])],
        "runs_exchange_over_raw": [
            round(r / o, 3) for r, o in zip(load4["raw"]["runs_s"], load4["exchange"]["runs_s"])
        ],
        "raw_bytes": load4["raw"]["sum_rank_needs"],
        # what `moeckpt train` resumes with here (one host, local disk): --resume-reads auto picks "own"
        "trainer_reads_here": "own",
        "raw": load4,
    }
    if args.only == "load":
        doc = {
            "benchmark": "reshard_load",
            "command": "python benchmarks/bench_reshard.py " + " ".join(sys.argv[1:]),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"nproc": os.cpu_count(), "torch": torch.__version__},
            "payload_gb": round(payload / 1e9, 4),
            "source_layout": source.to_json(),
            "target_layout": target.to_json(),
            "load_4_ranks": load_summary,
        }
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "reshard_load.json"), "w") as f:
            json.dump(doc, f, indent=1)
        print(json.dumps({k: v for k, v in load_summary.items() if k != "raw"}, indent=1))
        shutil.rmtree(args.dir, ignore_errors=True)
        return

    sweep = {}
    for dp in (int(x) for x in args.sweep_dp.split(",")):
        layout = Layout(tp=1, ep=min(dp, 4), dp=dp)
        res = load4 if layout == target else run_loads(args, layout.world, layout, LOAD_METHODS, src, dcp_path)
        sweep[str(dp)] = {
            "layout": layout.to_json(),
            **{f"{m}_read_over_needed": round(v["bytes_read"] / payload, 4) for m, v in res.items()},
            "sum_of_rank_needs_over_needed": round(res["exchange"]["sum_rank_needs"] / payload, 4),
            "raw": res,
        }
        print(
            f"dp={dp}: " + ", ".join(f"{k}={v}" for k, v in sweep[str(dp)].items() if k.endswith("needed")), flush=True
        )

    read = read_sweep(args)
    gb = payload / 1e9
    summary = {
        "benchmark": "reshard",
        "command": "python benchmarks/bench_reshard.py " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"nproc": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "payload_gb": round(gb, 4),
        "checkpoint_bytes_on_disk": {"moeckpt": dir_bytes(src), "dcp": dir_bytes(dcp_path)},
        "source_layout": source.to_json(),
        "target_layout": target.to_json(),
        "offline": {
            "cp_s": round(ob["cp"]["s"], 3),
            "moeckpt_s": round(ob["moeckpt"]["s"], 3),
            "cp_gb_per_s": round(gb / ob["cp"]["s"], 3),
            "moeckpt_gb_per_s": round(gb / ob["moeckpt"]["s"], 3),
            "ratio_moeckpt_over_cp": round(ob["cp"]["s"] / ob["moeckpt"]["s"], 3),
            "moeckpt_peak_rss_mb": round(ob["moeckpt"]["peak_rss_bytes"] / 1e6, 1),
            "moeckpt_writer_peak_rss_mb": round(ob["moeckpt"]["writer_peak_rss_bytes"] / 1e6, 1),
            "interpreter_baseline_rss_mb": round(offline["baseline_rss_bytes"] / 1e6, 1),
            "moeckpt_bytes_read": ob["moeckpt"]["bytes_read"],
            "workers": args.workers,
            "runs": offline["runs"],
        },
        "load_4_ranks": load_summary,
        "bytes_read_over_needed": sweep,
        "offline_read_sweep": read,
        "targets": {"offline_over_cp": 0.8, "load_over_dcp": 1.8, "load_over_raw": 0.9, "read_over_needed": 1.05},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reshard.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, os.path.join(args.out, "reshard.png"))
    print(json.dumps({k: summary[k] for k in ("offline", "load_4_ranks")}, indent=1, default=str)[:3000])
    shutil.rmtree(args.dir, ignore_errors=True)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    off = summary["offline"]
    ax = axes[0]
    vals = [off["cp_gb_per_s"], off["moeckpt_gb_per_s"]]
    ax.bar(["cp -r + sync", "moeckpt reshard"], vals, color=["#999999", "#1f77b4"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax.set_ylabel("GB/s")
    ax.set_title(
        f"offline, {summary['payload_gb']:.2f} GB: ratio {off['ratio_moeckpt_over_cp']:.2f} (target 0.8)", fontsize=9
    )
    ld = summary["load_4_ranks"]
    ax = axes[1]
    names = LOAD_METHODS
    vals = [ld[f"{m}_gb_per_s"] for m in names]
    ax.bar(["moeckpt\nexchange", "moeckpt own\n(resume here)", "DCP"], vals, color=["#6baed6", "#1f77b4", "#999999"])
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax.set_title(
        f"load with reshard into 4 ranks (median): own {ld['ratio_own_over_dcp']:.2f}x, exchange "
        f"{ld['ratio_exchange_over_dcp']:.2f}x DCP (target 1.8)",
        fontsize=8,
    )
    ax = axes[2]
    dps = list(summary["bytes_read_over_needed"])
    width = 0.27
    for k, (m, color) in enumerate([("exchange", "#6baed6"), ("own", "#1f77b4"), ("dcp", "#999999")]):
        ys = [summary["bytes_read_over_needed"][d][f"{m}_read_over_needed"] for d in dps]
        ax.bar([i + (k - 1) * width for i in range(len(dps))], ys, width, label=m, color=color)
    ax.axhline(1.05, color="red", lw=0.8, ls="--", label="1.05")
    ax.set_xticks(range(len(dps)), [f"dp={d}" for d in dps])
    ax.set_ylabel("bytes read / bytes needed")
    ax.set_title("storage reads on resume", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
