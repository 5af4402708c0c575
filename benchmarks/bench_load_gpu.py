"""Load with reshard into GPU memory, side by side in one run on one GPU: moeckpt vs a raw read vs torch DCP.

The state is ``zaya-small`` with bf16 parameters, fp32 master weights and AdamW moments (6.46 GB; ``--gb`` a
smaller widened one, as in bench_reshard.py), saved once by moeckpt in layout (1,1,1) and once by
``torch.distributed.checkpoint`` (one process, plain tensors). The page cache is warmed (every file read once)
before the timed runs; each repetition runs every method in turn, starting with another one each time:

* ``moeckpt``: ``load_rank_state(..., device=, out=)`` into preallocated device tensors (pinned staging buffers,
  host-to-device copies on side streams overlapped with the reads, ``fill_threads`` threads);
* ``moeckpt_then_to``: ``load_rank_state`` to the CPU, then ``.to(device)`` of every box (what a caller did before
  ``device=``, the issue's 0.18x row);
* ``raw``: the same files read by ``fill_threads`` threads (``pread``, 64 MiB at a time) into preallocated pinned
  memory, then one copy to a preallocated device buffer: the physical limit of this machine;
* ``dcp``: ``dcp.load`` of the same state into preallocated device tensors.

Times end after ``torch.cuda.synchronize()``. Results: ``docs/benchmarks/gpu/load_gpu.json`` and ``.png``.

    python benchmarks/bench_load_gpu.py                              # H200: zaya-small + AdamW, 6.46 GB
    python benchmarks/bench_load_gpu.py --device cpu --gb 0.1        # a CPU-only check of the script
"""

from __future__ import annotations

import argparse
import cProfile
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
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.save import save_full_tensors
from moeckpt.trainer.models import presets

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reshard import scaled_model, state_tensors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["moeckpt", "moeckpt_then_to", "raw", "dcp"]
ONE = Layout(tp=1, ep=1, dp=1)


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


def raw_read(files: list[str], host: torch.Tensor, dev: torch.Tensor, threads: int) -> int:
    """``files`` end to end into ``host`` by ``threads`` threads in 64 MiB preads, then one copy to ``dev``."""
    view = host.numpy().data
    jobs, at = [], 0
    for f in files:
        size = os.path.getsize(f)
        for off in range(0, size, 64 << 20):
            jobs.append((f, off, min(64 << 20, size - off), at + off))
        at += size

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="where the state is loaded (cuda; cpu for a check)")
    ap.add_argument("--gb", type=float, default=0.0, help="a widened zaya-small of this size instead of zaya-small")
    ap.add_argument("--reps", type=int, default=3, help="repetitions (every method in each, in rotating order)")
    ap.add_argument("--threads", type=int, default=0, help="fill threads (default: LoadOptions' default)")
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-load-gpu", help="scratch directory (local disk)")
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks", "gpu"), help="where JSON and PNG go")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile moeckpt's last load (the calling thread's calls; the fill threads' work shows as "
        "waits): OUT/load_gpu_profile.txt",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --device cpu for a check of the script", file=sys.stderr)
        raise SystemExit(0)
    options = LoadOptions(fill_threads=args.threads) if args.threads else LoadOptions()
    threads = options.fill_threads
    spec = scaled_model(args.gb) if args.gb else presets()["zaya-small"]
    tensors = state_tensors(spec)
    payload = sum(e.nbytes for e in tensors.values())
    print(f"state: {payload / 1e9:.3f} GB, {len(tensors)} tensors, {threads} threads, device {device}", flush=True)

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    src, dcp_path = os.path.join(args.dir, "moeckpt"), os.path.join(args.dir, "dcp")
    g = torch.Generator().manual_seed(0)
    values = {n: torch.randn(e.shape, generator=g).to(dtypes.to_torch(e.dtype)) for n, e in tensors.items()}
    save_full_tensors(
        src, tensors=tensors, layout=ONE, model=spec.to_json(), step=1, values=lambda e, v=values: v[e.name]
    )
    import torch.distributed.checkpoint as dcp

    dcp.save(values, checkpoint_id=dcp_path)
    del values
    print("saved both", flush=True)

    # Destinations, allocated once: what a trainer's resume fills.
    dest = {n: torch.empty(e.shape, dtype=dtypes.to_torch(e.dtype), device=device) for n, e in tensors.items()}
    out = {(n, Box((0,) * len(e.shape), tuple(e.shape))): dest[n] for n, e in tensors.items()}
    files = data_files(src)
    total = sum(os.path.getsize(f) for f in files)
    pin = device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    dev_buf = torch.empty(total, dtype=torch.uint8, device=device) if device.type != "cpu" else host
    warm(src)
    warm(dcp_path)

    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    for rep in range(args.reps):
        for method in METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]:
            sync(device)
            t0 = time.perf_counter()
            extra: dict = {}
            if method == "moeckpt":
                stats = LoadStats()
                prof = cProfile.Profile() if args.profile and rep == args.reps - 1 else None
                if prof is not None:
                    prof.enable()
                state = load_rank_state(src, ONE, 0, device=device, out=out, stats=stats, options=options)
                sync(device)
                if prof is not None:
                    prof.disable()
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, "load_gpu_profile.txt"), "w") as f:
                        f.write(f"load_rank_state(device={device}, out=...), the last repetition, under cProfile\n")
                        for order in ("cumulative", "tottime"):
                            pstats.Stats(prof, stream=f).sort_stats(order).print_stats(35)
                extra = {
                    "bytes_read": stats.bytes_read,
                    "in_place": all(t is out[(n, b)] for n, boxes in state.items() for b, t in boxes),
                }
            elif method == "moeckpt_then_to":
                state = load_rank_state(src, ONE, 0, options=options)
                moved = {n: [t.to(device) for _, t in boxes] for n, boxes in state.items()}
                sync(device)
                del moved
            elif method == "raw":
                extra = {"bytes_read": raw_read(files, host, dev_buf, threads)}
                sync(device)
            else:
                dcp.load(dest, checkpoint_id=dcp_path)
                sync(device)
            runs[method].append({"s": round(time.perf_counter() - t0, 4), **extra})
            state = None
            print(f"rep {rep} {method}: {runs[method][-1]['s']:.3f} s", flush=True)

    med = {m: sorted(r["s"] for r in runs[m])[len(runs[m]) // 2] for m in METHODS}
    gb = payload / 1e9
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
        "payload_gb": round(gb, 4),
        "threads": threads,
        "median_s": med,
        "gb_per_s": {m: round(gb / s, 3) for m, s in med.items()},
        "ratio_moeckpt_over_raw": round(med["raw"] / med["moeckpt"], 3),
        "ratio_moeckpt_over_dcp": round(med["dcp"] / med["moeckpt"], 3),
        "ratio_then_to_over_raw": round(med["raw"] / med["moeckpt_then_to"], 3),
        "runs_moeckpt_over_raw": [round(r["s"] / o["s"], 3) for r, o in zip(runs["raw"], runs["moeckpt"])],
        "runs_moeckpt_over_dcp": [round(d["s"] / o["s"], 3) for d, o in zip(runs["dcp"], runs["moeckpt"])],
        "runs": runs,
        "targets": {"moeckpt_over_raw": 0.9, "moeckpt_over_dcp": 1.8},
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "load_gpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    plot(summary, os.path.join(args.out, "load_gpu.png"))
    print(
        json.dumps(
            {k: summary[k] for k in ("median_s", "gb_per_s", "runs_moeckpt_over_raw", "runs_moeckpt_over_dcp")},
            indent=1,
        )
    )
    shutil.rmtree(args.dir, ignore_errors=True)


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = {
        "moeckpt": "moeckpt\ndevice=",
        "moeckpt_then_to": "moeckpt\nthen .to()",
        "raw": "raw pread\n+ copy",
        "dcp": "DCP\ndcp.load",
    }
    for i, m in enumerate(METHODS):
        ys = [r["s"] for r in summary["runs"][m]]
        ax.scatter([i] * len(ys), [summary["payload_gb"] / y for y in ys], color="#1f77b4", s=14)
        v = summary["gb_per_s"][m]
        ax.bar(i, v, color=["#1f77b4", "#6baed6", "#999999", "#cccccc"][i], alpha=0.7)
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(METHODS)), [labels[m] for m in METHODS], fontsize=8)
    ax.set_ylabel("GB/s (bars: median; dots: every repetition)")
    ax.set_title(
        f"load into {summary['machine']['device']} memory, {summary['payload_gb']:.2f} GB: "
        f"{summary['ratio_moeckpt_over_raw']:.2f}x raw, {summary['ratio_moeckpt_over_dcp']:.2f}x DCP "
        "(targets 0.9, 1.8)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
