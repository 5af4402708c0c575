"""Loads into GPU memory that reshard, side by side in one run on one GPU: moeckpt vs a raw read vs torch DCP.

The state is ``zaya-small`` with bf16 parameters, fp32 master weights and AdamW moments (6.46 GB; ``--gb`` a
smaller widened one, as in bench_reshard.py), saved by moeckpt in the stored layouts the cases need and once by
``torch.distributed.checkpoint`` (one process, plain tensors). Each case (``--cases``) loads one rank of a target
layout from one stored layout, the classes a resume or an elastic restart hits:

* ``identity``: stored (1,1,1), loaded as (1,1,1);
* ``join``: stored (tp,ep,dp) = (1,2,2), loaded as (1,1,1): expert halves and ZeRO-1 parts joined;
* ``tp-split``: stored (1,1,1), loaded as rank 0 of (2,1,1): a TP half of every split matrix;
* ``join-tp``: stored (1,2,2), loaded as rank 0 of (2,1,1): both.

The page cache is warmed (every file read once) before the timed runs; each repetition runs every method in
turn, starting with another one each time:

* ``moeckpt``: ``load_rank_state(..., device=, out=)`` into preallocated device tensors, ``fill_threads`` threads:
  every byte hashed on the host; whole stored rows copied to the device straight from page-locked mappings of the
  files (the page cache itself, ``moeckpt.reshard.page_lock``; ``locked_bytes`` is what went that way), the rest
  through pinned staging buffers, copies on side streams overlapped with the reads;
* ``device_checks``: the same with ``LoadOptions(checksums_on_device=True)``: parts of whole checksum blocks read
  unhashed through pinned staging and hashed on the GPU where they land (``moeckpt.reshard.device_checks``, a
  Triton kernel; the first load of the process includes Triton's start);
* ``raw``: the stored layout's files read by a thread per core (``fill_threads`` where more; ``pread``, 64 MiB
  at a time) into preallocated pinned memory, then one copy to a preallocated device buffer: the physical limit of this machine
  for those files; ``raw_needed`` the same for the first bytes of them, as many as the rank needs (the limit of
  a reader that fetches only its bytes: what a TP rank is measured against);
* ``dcp``: ``dcp.load`` of the same state into preallocated device tensors (whole-tensor targets only).

Times end after ``torch.cuda.synchronize()``. Results: ``docs/benchmarks/gpu/load_gpu.json`` and ``.png``.
``--keep`` leaves the saved checkpoints for a later run (``--reuse``, e.g. another tree's ``--methods moeckpt``).

    python benchmarks/bench_load_gpu.py --reps 5                     # H200: zaya-small + AdamW, 6.46 GB
    python benchmarks/bench_load_gpu.py --device cpu --gb 0.1        # a CPU-only check of the script
    python benchmarks/bench_load_gpu.py --device cpu --stage-host     # the device path's staging, on the host
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.reshard import page_lock, staging
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.planner import plan_load
from moeckpt.reshard.save import save_full_tensors
from moeckpt.trainer.models import presets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reshard import scaled_model, state_tensors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["moeckpt", "device_checks", "raw", "raw_needed", "dcp"]
ONE = Layout(tp=1, ep=1, dp=1)
#: case -> (stored layout, target layout, target rank)
CASES = {
    "identity": (ONE, ONE, 0),
    "join": (Layout(tp=1, ep=2, dp=2), ONE, 0),
    "tp-split": (ONE, Layout(tp=2, ep=1, dp=1), 0),
    "join-tp": (Layout(tp=1, ep=2, dp=2), Layout(tp=2, ep=1, dp=1), 0),
}


def layout_name(layout: Layout) -> str:
    return f"tp{layout.tp}-ep{layout.ep}-dp{layout.dp}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def data_files(path: str) -> list[str]:
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.join(root, n) for n in names if not n.endswith(".json")]
    return sorted(out)


def warm(path: str) -> None:
    """Read every file once, so every method reads from the page cache."""
    for f in data_files(path):
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def raw_read(files: list[str], host: torch.Tensor, dev: torch.Tensor, threads: int, limit: int | None = None) -> int:
    """``files`` end to end (their first ``limit`` bytes) into ``host`` by ``threads`` threads in 64 MiB preads,
    then one copy to ``dev``."""
    view = host.numpy().data
    jobs, at = [], 0
    for f in files:
        size = os.path.getsize(f)
        if limit is not None:
            size = min(size, limit - at)
        for off in range(0, size, 64 << 20):
            jobs.append((f, off, min(64 << 20, size - off), at + off))
        at += size
        if limit is not None and at >= limit:
            break

    def read(job) -> int:
        f, off, n, pos = job
        fd = os.open(f, os.O_RDONLY)
        try:
            return os.preadv(fd, [view[pos : pos + n]], off)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(read, jobs))
    if dev.data_ptr() != host.data_ptr():
        dev[:at].copy_(host[:at], non_blocking=True)
    return got


class CountingRegistrar:
    """The load's registrar, counting the bytes it page-locks (to show which way a load went)."""

    def __init__(self, inner):
        self.inner = inner
        self.bytes = 0

    def register(self, address: int, nbytes: int) -> bool:
        ok = self.inner.register(address, nbytes)
        self.bytes += nbytes if ok else 0
        return ok

    def unregister(self, address: int) -> None:
        self.inner.unregister(address)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="where the state is loaded (cuda; cpu for a check)")
    ap.add_argument("--gb", type=float, default=0.0, help="a widened zaya-small of this size instead of zaya-small")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (every method in each, in rotating order)")
    ap.add_argument("--threads", type=int, default=0, help="fill threads (default: LoadOptions' default)")
    ap.add_argument("--stage-mib", type=int, default=0, help="LoadOptions.stage_bytes in MiB (default: its default)")
    ap.add_argument("--mapped-mib", type=int, default=-1, help="LoadOptions.mapped_bytes in MiB (default: its default)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-load-gpu", help="scratch directory (local disk)")
    ap.add_argument("--keep", action="store_true", help="leave the saved checkpoints in --dir")
    ap.add_argument("--reuse", action="store_true", help="load the checkpoints a --keep run left in --dir")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks", "gpu"), help="where JSON and PNG go")
    ap.add_argument("--name", default="load_gpu", help="file name of the JSON and PNG (without extension)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile moeckpt's last load of each case (the calling thread's calls; the fill threads' work shows "
        "as waits): OUT/NAME_profile.txt",
    )
    ap.add_argument(
        "--stage-host",
        action="store_true",
        help="with --device cpu: load through the staged device path (staging buffers and their copies) on the host, "
        "as the tests of that path do, to measure it on a machine without a GPU",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.stage_host:
        staging.STAGE_HOST_MEMORY = True
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --device cpu for a check of the script", file=sys.stderr)
        raise SystemExit(0)
    cases = [c for c in args.cases.split(",") if c]
    methods = [m for m in args.methods.split(",") if m]
    if unknown := set(cases) - set(CASES) | set(methods) - set(METHODS):
        raise SystemExit(f"unknown cases or methods: {sorted(unknown)}")
    tuned = {"fill_threads": args.threads} if args.threads else {}
    if args.stage_mib:
        tuned["stage_bytes"] = args.stage_mib << 20
    if args.mapped_mib >= 0:
        tuned["mapped_bytes"] = args.mapped_mib << 20
    options = LoadOptions(**tuned)
    on_device = dataclasses.replace(options, checksums_on_device=True)  # the device_checks method's options
    registrar = page_lock.registrar_for(device)
    counting = CountingRegistrar(registrar) if registrar is not None else None
    if counting is not None:
        page_lock.registrar_for = lambda d: counting  # type: ignore[assignment]
    print("page-locked copies:", "the CUDA driver's" if counting is not None else "none (every part stages)")
    threads = options.fill_threads
    # the raw read's threads: the host's cores, or moeckpt's count where that is more (the machine's limit)
    raw_threads = max(threads, len(os.sched_getaffinity(0)))
    spec = scaled_model(args.gb) if args.gb else presets()["zaya-small"]
    tensors = state_tensors(spec)
    payload = sum(e.nbytes for e in tensors.values())
    print(f"state: {payload / 1e9:.3f} GB, {len(tensors)} tensors, {threads} threads, device {device}", flush=True)

    stored = {layout_name(CASES[c][0]): CASES[c][0] for c in cases}
    dcp_path = os.path.join(args.dir, "dcp")
    import torch.distributed.checkpoint as dcp

    if not args.reuse:
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        g = torch.Generator().manual_seed(0)
        values = {n: torch.randn(e.shape, generator=g).to(dtypes.to_torch(e.dtype)) for n, e in tensors.items()}
        for name, layout in stored.items():
            save_full_tensors(
                os.path.join(args.dir, name),
                tensors=tensors,
                layout=layout,
                model=spec.to_json(),
                step=1,
                values=lambda e, v=values: v[e.name],
            )
        if "dcp" in methods:
            dcp.save(values, checkpoint_id=dcp_path)
        del values
        print("saved", ", ".join(stored), flush=True)
    for name in stored:
        warm(os.path.join(args.dir, name))
    if "dcp" in methods:
        warm(dcp_path)

    largest = max(sum(os.path.getsize(f) for f in data_files(os.path.join(args.dir, n))) for n in stored)
    pin = device.type == "cuda"
    host = torch.empty(largest, dtype=torch.uint8, pin_memory=pin)
    dev_buf = torch.empty(largest, dtype=torch.uint8, device=device) if device.type != "cpu" else host
    results = {}
    profiles = []
    for case in cases:
        source, target, rank = CASES[case]
        src = os.path.join(args.dir, layout_name(source))
        files = data_files(src)
        reader = CheckpointReader(src)
        (rank_plan,) = plan_load(reader.index, target, [rank]).ranks
        # Destinations, allocated once: what a trainer's resume fills.
        out = {
            (p.tensor, p.box): torch.empty(p.box.shape, dtype=dtypes.to_torch(tensors[p.tensor].dtype), device=device)
            for p in rank_plan.pieces
        }
        needed = sum(t.numel() * t.element_size() for t in out.values())
        whole = target.world == 1
        dest = {n: out[(n, Box((0,) * len(e.shape), tuple(e.shape)))] for n, e in tensors.items()} if whole else None
        todo = [m for m in methods if m != "dcp" or whole]
        if "raw_needed" in todo and whole:
            todo.remove("raw_needed")  # the rank needs every byte: the same as raw
        runs: dict[str, list[dict]] = {m: [] for m in todo}
        for rep in range(args.reps):
            for method in todo[rep % len(todo) :] + todo[: rep % len(todo)]:
                sync(device)
                t0 = time.perf_counter()
                extra: dict = {}
                if method in ("moeckpt", "device_checks"):
                    stats = LoadStats()
                    prof = cProfile.Profile() if args.profile and rep == args.reps - 1 else None
                    how = options if method == "moeckpt" else on_device
                    locked = counting.bytes if counting is not None else 0
                    if prof is not None:
                        prof.enable()
                    state = load_rank_state(src, target, rank, device=device, out=out, stats=stats, options=how)
                    sync(device)
                    if prof is not None:
                        prof.disable()
                        profiles.append((f"{case} {method}", prof))
                    extra = {
                        "bytes_read": stats.bytes_read,
                        "locked_bytes": (counting.bytes if counting is not None else 0) - locked,
                        "in_place": all(t is out[(n, b)] for n, boxes in state.items() for b, t in boxes),
                    }
                    state = None
                elif method == "raw":
                    extra = {"bytes_read": raw_read(files, host, dev_buf, raw_threads)}
                    sync(device)
                elif method == "raw_needed":
                    extra = {"bytes_read": raw_read(files, host, dev_buf, raw_threads, limit=needed)}
                    sync(device)
                else:
                    dcp.load(dest, checkpoint_id=dcp_path)
                    sync(device)
                runs[method].append({"s": round(time.perf_counter() - t0, 4), **extra})
                locked = f", {extra['locked_bytes'] / 1e9:.2f} GB page-locked" if extra.get("locked_bytes") else ""
                print(f"{case} rep {rep} {method}: {runs[method][-1]['s']:.3f} s{locked}", flush=True)
        equal = None
        if {"moeckpt", "device_checks"} <= set(todo):  # the two ways land the same bytes (checked after the timed runs)
            load_rank_state(src, target, rank, device=device, out=out, options=options)
            first = {k: t.clone() for k, t in out.items()}
            load_rank_state(src, target, rank, device=device, out=out, options=on_device)
            equal = all(torch.equal(first[k], t) for k, t in out.items())
            del first
            print(f"{case}: loads hashing on the device and on the host equal: {equal}", flush=True)
        del out, dest
        results[case] = summarize(case, runs, needed, source, target, rank)
        results[case]["device_checks_equal_to_host_checks"] = equal  # None where one of the two did not run
        print(json.dumps({case: {k: results[case].get(k) for k in ("median_s", "runs_moeckpt_over")}}), flush=True)

    summary = {
        "benchmark": "load_gpu",
        "command": "python benchmarks/bench_load_gpu.py " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "nproc": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "moeckpt_from": os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["moeckpt.reshard"].__file__))),
        "payload_gb": round(payload / 1e9, 4),
        "threads": threads,
        "stage_host": args.stage_host,
        "raw_threads": raw_threads,
        "stage_bytes": options.stage_bytes,
        "mapped_bytes": options.mapped_bytes,
        "cases": results,
        "targets": {"moeckpt_over_raw": 0.9, "moeckpt_over_dcp": 1.8, "tp_rank_read_over_needed": 1.05},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(summary, f, indent=1)
    if profiles:
        with open(os.path.join(args.out, args.name + "_profile.txt"), "w") as f:
            for case, prof in profiles:
                f.write(f"{case}: load_rank_state(device={device}, out=...), the last repetition, under cProfile\n")
                for order in ("cumulative", "tottime"):
                    pstats.Stats(prof, stream=f).sort_stats(order).print_stats(30)
    plot(summary, os.path.join(args.out, args.name + ".png"))
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


def summarize(case: str, runs: dict[str, list[dict]], needed: int, source: Layout, target: Layout, rank: int) -> dict:
    """Medians, and every repetition's ratio of each method's time to moeckpt's (> 1: moeckpt faster)."""
    med = {m: sorted(r["s"] for r in rs)[len(rs) // 2] for m, rs in runs.items()}
    out = {
        "stored": layout_name(source),
        "target": f"{layout_name(target)} rank {rank}",
        "needed_gb": round(needed / 1e9, 4),
        "median_s": med,
        "gb_per_s": {m: round(needed / 1e9 / s, 3) for m, s in med.items()},
        "runs": runs,
    }
    if "moeckpt" in runs:
        mine = runs["moeckpt"]
        out["runs_moeckpt_over"] = {
            m: [round(o["s"] / r["s"], 3) for r, o in zip(mine, rs)] for m, rs in runs.items() if m != "moeckpt"
        }
        out["read_over_needed"] = [round(r["bytes_read"] / needed, 4) for r in mine]
    return out


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = summary["cases"]
    colors = {
        "moeckpt": "#1f77b4",
        "device_checks": "#aec7e8",
        "raw": "#999999",
        "raw_needed": "#bbbbbb",
        "dcp": "#dddddd",
    }
    fig, ax = plt.subplots(figsize=(2.4 + 2.2 * len(cases), 4))
    width = 0.16
    labelled: set[str] = set()
    for i, res in enumerate(cases.values()):
        for j, m in enumerate(METHODS):
            if m not in res["runs"]:
                continue
            x = i + (j - (len(METHODS) - 1) / 2) * width
            ys = [res["needed_gb"] / r["s"] for r in res["runs"][m]]
            names = {"raw_needed": "raw, the rank's bytes only", "device_checks": "moeckpt, hashing on the GPU"}
            label = None if m in labelled else names.get(m, m)
            labelled.add(m)
            ax.bar(x, res["gb_per_s"][m], width, color=colors[m], label=label, edgecolor="#555")
            ax.scatter([x] * len(ys), ys, color="black", s=8, zorder=3)
            ax.text(x, res["gb_per_s"][m], f"{res['gb_per_s'][m]:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(cases)), [f"{c}\n{r['stored']} -> {r['target']}" for c, r in cases.items()], fontsize=7)
    ax.set_ylabel("GB/s of the rank's state\n(bars: median; dots: every repetition)", fontsize=8)
    ax.set_title(
        f"loads into {summary['machine']['device']} memory, {summary['payload_gb']:.2f} GB state (targets: >= 0.9x raw,"
        " >= 1.8x DCP)",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
