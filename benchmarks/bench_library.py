"""Library-API benchmark: ``moeckpt.save``/``load`` and ``moeckpt.dcp`` against torch DCP, side by side in one run.

CPU mode (default): four gloo processes hold a ZAYA training state (bf16 parameters, fp32 master and AdamW
moments) as DTensors on a (edp, ep, tp) mesh of layout ``--save-layout`` (``benchmarks/dcp_state.py``), built
before any timing. After ``--warmup`` untimed rounds (kept apart in the JSON), each repetition (method order
rotated) times, from a barrier to a barrier, each method starting from a collected heap:

* ``save``: ``moeckpt.save(sd)`` vs ``dcp.save(sd)`` (DCP's FileSystemWriter, fsynced) vs
  ``dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(...))``, and ``dcp.save(sd)`` again as a control (its
  ratio to the first shows how far the machine alone moves a per-round ratio);
* ``load``: into DTensors of another mesh (``--load-layout``), ``moeckpt.load`` of the moeckpt checkpoint vs
  ``dcp.load`` of the DCP one (page cache warm for both: each was just written).

GPU mode (``--gpu``, one process): the state on the GPU; ``moeckpt.async_save`` blocked time (the second save,
buffers reused) against a device-to-host copy of the same bytes into preallocated pinned memory, and against
``dcp.async_save``'s blocked time.

Results (every repetition and the medians) go to ``docs/benchmarks/library.json`` (``library_gpu.json``) and a PNG.

    python benchmarks/bench_library.py --gb 1.07 --reps 5
    python benchmarks/bench_library.py --gb 0.05 --reps 1 --out /tmp/lib      # a quick check
    python benchmarks/bench_library.py --gpu --gb 8 --reps 5                    # on a GPU machine
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import scaled_model, state_tensors
from dcp_state import dcp_state

from moeckpt.reshard.layout import Layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: "dcp-again" is the control: DCP's save a second time in the same round. Its ratio to the first is 1 but for
#: the machine's noise (a virtual disk's throughput moves from second to second), which every other per-round
#: ratio carries as well.
SAVES = ("moeckpt", "dcp", "dcp+moeckpt-writer", "dcp-again")
LOADS = ("moeckpt", "dcp")


def _layout(text: str) -> Layout:
    tp, ep, dp = (int(x) for x in text.split(","))
    return Layout(tp=tp, ep=ep, dp=dp)


def _timed(fn) -> float:
    # Every method starts from a collected heap: DCP's planning leaves many objects behind, and the full
    # collection they trigger would otherwise fall on whichever method runs next.
    gc.collect()
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    import torch.distributed.checkpoint as dcp

    import moeckpt
    import moeckpt.dcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = scaled_model(args.gb)
    tensors = state_tensors(model)
    save_layout, load_layout = _layout(args.save_layout), _layout(args.load_layout)
    sd = dcp_state(tensors, save_layout, torch.Generator().manual_seed(rank))
    target = dcp_state(tensors, load_layout, None)
    state_bytes = sum(e.nbytes for e in tensors.values())
    base = args.dir
    paths = {m: os.path.join(base, m.replace("+", "_")) for m in SAVES}
    savers = {
        "moeckpt": lambda: moeckpt.save(sd, paths["moeckpt"], overwrite=True),
        "dcp": lambda: dcp.save(sd, checkpoint_id=paths["dcp"]),
        "dcp-again": lambda: dcp.save(sd, checkpoint_id=paths["dcp-again"]),
        "dcp+moeckpt-writer": lambda: dcp.save(
            sd, storage_writer=moeckpt.dcp.StorageWriter(paths["dcp+moeckpt-writer"], overwrite=True)
        ),
    }
    loaders = {
        "moeckpt": lambda: moeckpt.load(target, paths["moeckpt"]),
        "dcp": lambda: dcp.load(target, checkpoint_id=paths["dcp"]),
    }
    times: dict[str, dict[str, list[float]]] = {"save": {m: [] for m in SAVES}, "load": {m: [] for m in LOADS}}
    warmup: dict[str, dict[str, list[float]]] = {"save": {m: [] for m in SAVES}, "load": {m: [] for m in LOADS}}
    for rep in range(-args.warmup, args.reps):
        into = warmup if rep < 0 else times
        order = SAVES[rep % len(SAVES) :] + SAVES[: rep % len(SAVES)]
        for m in order:
            # Every method starts from nothing on disk and no dirty pages: the previous output is removed (and
            # its deletion not timed) and the page cache flushed, so no save pays for another's writeback.
            if rank == 0:
                if os.path.exists(paths[m]):
                    shutil.rmtree(paths[m])
                os.sync()
                time.sleep(args.settle)
            dist.barrier()
            into["save"][m].append(_timed(savers[m]))
        lorder = LOADS[rep % len(LOADS) :] + LOADS[: rep % len(LOADS)]
        for m in lorder:
            if rank == 0:  # the saves' writeback done, as before each save (the files stay in the page cache)
                os.sync()
                time.sleep(args.settle)
            dist.barrier()
            into["load"][m].append(_timed(loaders[m]))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "warmup": warmup, "state_bytes": state_bytes}, f)
    dist.destroy_process_group()


def cpu_main(args) -> dict:
    from moeckpt.trainer.local_world import free_port

    world = _layout(args.save_layout).world
    if _layout(args.load_layout).world != world:
        raise SystemExit("--save-layout and --load-layout must have the same world size")
    os.makedirs(args.dir, exist_ok=True)
    out_path = os.path.join(args.dir, "times.json")
    mp.spawn(_worker, args=(world, free_port(), args, out_path), nprocs=world, join=True)
    raw = json.load(open(out_path))
    times, nbytes = raw["times"], raw["state_bytes"]
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    save, load = times["save"], times["load"]

    def per_rep(num: list[float], den: list[float]) -> list[float]:
        return [n / d for n, d in zip(num, den)]

    return {
        "command": " ".join(["python", "benchmarks/bench_library.py"] + sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "ranks": world,
        "save_layout": args.save_layout,
        "load_layout": args.load_layout,
        "state_bytes": nbytes,
        "reps": args.reps,
        "times_s": times,
        "median_s": med,
        "warmup_s": raw["warmup"],
        "ratios": {
            "save_vs_dcp": med["save"]["dcp"] / med["save"]["moeckpt"],
            "load_vs_dcp": med["load"]["dcp"] / med["load"]["moeckpt"],
            "dcp_writer_vs_filesystem_writer": med["save"]["dcp"] / med["save"]["dcp+moeckpt-writer"],
        },
        "targets": {"save_vs_dcp": 1.8, "load_vs_dcp": 1.8, "dcp_writer_vs_filesystem_writer": 1.0},
        "per_rep_ratios": {
            "save_vs_dcp": per_rep(save["dcp"], save["moeckpt"]),
            "load_vs_dcp": per_rep(load["dcp"], load["moeckpt"]),
            "dcp_writer_vs_filesystem_writer": per_rep(save["dcp"], save["dcp+moeckpt-writer"]),
            "control_dcp_vs_dcp_again": per_rep(save["dcp"], save["dcp-again"]),
        },
    }


def gpu_main(args) -> dict:
    import torch.distributed.checkpoint as dcp

    import moeckpt

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a GPU (torch.cuda.is_available() is False)")
    dev = torch.device("cuda")
    n = int(args.gb * 1e9 / 2 / 64)  # 64 bf16 tensors
    sd = {f"t{i}": torch.randn(n, device=dev, dtype=torch.bfloat16) for i in range(64)}
    torch.cuda.synchronize()
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}
    base = args.dir
    d2h, blocked, dcp_blocked, persist = [], [], [], []
    for rep in range(args.reps + 1):  # the first save allocates and pins: reported apart
        t0 = time.perf_counter()
        for k, v in sd.items():
            pinned[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - t0)
        h = moeckpt.async_save(sd, os.path.join(base, f"m{rep}"), overwrite=True)
        blocked.append(h.stats.blocked_s)
        h.wait()
        persist.append(h.stats.persist_s)
        t0 = time.perf_counter()
        f = dcp.async_save(sd, checkpoint_id=os.path.join(base, f"d{rep}"))
        dcp_blocked.append(time.perf_counter() - t0)
        f.result()
        shutil.rmtree(os.path.join(base, f"m{rep}"), ignore_errors=True)
        shutil.rmtree(os.path.join(base, f"d{rep}"), ignore_errors=True)
    med = {
        "d2h": statistics.median(d2h[1:]),
        "moeckpt_blocked": statistics.median(blocked[1:]),
        "dcp_async_blocked": statistics.median(dcp_blocked[1:]),
    }
    return {
        "command": " ".join(["python", "benchmarks/bench_library.py"] + sys.argv[1:]),
        "gpu": torch.cuda.get_device_name(),
        "state_bytes": sum(v.numel() * 2 for v in sd.values()),
        "reps": args.reps,
        "d2h_s": d2h,
        "moeckpt_blocked_s": blocked,
        "moeckpt_persist_s": persist,
        "dcp_async_blocked_s": dcp_blocked,
        "median_s": med,
        "ratios": {
            "moeckpt_blocked_vs_d2h": med["moeckpt_blocked"] / med["d2h"],
            "dcp_blocked_vs_d2h": med["dcp_async_blocked"] / med["d2h"],
        },
        "targets": {"moeckpt_blocked_vs_d2h": 1.2},
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, kind in zip(axes, ("save", "load")):
        reps = result["times_s"][kind]
        names = list(reps)
        for i, m in enumerate(names):
            ax.scatter([i] * len(reps[m]), reps[m], s=14, alpha=0.6)
            ax.bar(i, result["median_s"][kind][m], alpha=0.35)
        ax.set_xticks(range(len(names)), names, rotation=12)
        ax.set_ylabel("seconds (bars: median; dots: every repetition)")
        gb = result["state_bytes"] / 1e9
        ax.set_title(f"{kind}, {gb:.2f} GB, {result['ranks']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.07, help="state size in GB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (CPU mode; their times are kept apart in the JSON): a fresh process "
        "and a fresh virtual machine pay first-touch page faults that later saves do not",
    )
    p.add_argument("--save-layout", default="2,2,2", help="tp,ep,dp of the saving mesh")
    p.add_argument("--load-layout", default="1,2,4", help="tp,ep,dp of the loading mesh")
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds to wait after flushing the page cache before each save and load (CPU mode): a "
        "virtual disk keeps writing the last save back for a while after the guest's sync returns, "
        "on host cores the guest's share",
    )
    p.add_argument("--gpu", action="store_true", help="the GPU async-save comparison instead")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks"), help="where results go")
    args = p.parse_args()
    if args.gb <= 0 or args.reps < 1 or args.warmup < 0 or args.settle < 0:
        raise SystemExit("--gb must be positive, --reps at least 1, --warmup and --settle not negative")
    scratch = args.dir or tempfile.mkdtemp(prefix="moeckpt-bench-library-")
    args.dir = scratch
    try:
        result = gpu_main(args) if args.gpu else cpu_main(args)
    finally:
        if not os.environ.get("MOECKPT_KEEP_SCRATCH"):
            shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    name = "library_gpu" if args.gpu else "library"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not args.gpu:
        plot(result, os.path.join(args.out, f"{name}.png"))
    print(json.dumps({"median_s": result["median_s"], "ratios": result["ratios"]}, indent=1))
    for name, values in result.get("per_rep_ratios", {}).items():
        print(f"{name} per repetition: " + ", ".join(f"{v:.2f}x" for v in values))


if __name__ == "__main__":
    main()
