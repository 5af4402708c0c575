"""The first device load in a process against the next ones: what a resume (always a process's first load) pays.

Loads one case of ``bench_load_gpu.py`` (its saved checkpoints, ``--dir`` of a ``--keep`` run) into preallocated
device tensors ``--loads`` times in this fresh process, after an optional warm-up that does one thing the first
load does, untimed as part of the loads (its own time printed), to see which of them the first load pays for:

* ``none``; ``pin``: pin and free 16 buffers of 16 MiB (the fill threads' staging buffers); ``streams``: a copy
  stream and an event in each of 8 threads; ``zero``: zero the destinations on the device; ``tiny``: a load of the
  three smallest tensors; ``cpu``: a load of every tensor to the CPU (the page cache); ``h2d``: a 4 GiB
  host-to-device copy; ``raw``: the raw read of bench_load_gpu.py (twice, timed).

One JSON line per invocation on stdout. Run each warm-up in its own process:

    python benchmarks/bench_load_gpu.py --reps 1 --cases identity --methods raw --keep --dir /var/tmp/lg
    for w in none pin streams zero tiny cpu h2d raw; do python benchmarks/first_load_gpu.py --dir /var/tmp/lg --warm $w; done
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.reshard.load import load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.planner import plan_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load_gpu import CASES, data_files, layout_name, raw_read

WARM = ["none", "pin", "streams", "zero", "tiny", "cpu", "h2d", "raw"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True, help="the --dir of a bench_load_gpu.py --keep run")
    ap.add_argument("--case", default="identity", choices=list(CASES))
    ap.add_argument("--warm", default="none", choices=WARM)
    ap.add_argument("--loads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=8, help="fill threads")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a check of the script")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here: run with --device cpu for a check of the script", file=sys.stderr)
        raise SystemExit(0)
    gpu = dev.type == "cuda"

    def timed(fn) -> float:
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if gpu:
            torch.cuda.synchronize()
        return round(time.perf_counter() - t, 4)

    torch.empty(1, device=dev)  # the device's context, made before anything is timed
    source, target, rank = CASES[args.case]
    src = os.path.join(args.dir, layout_name(source))
    reader = CheckpointReader(src)
    (rank_plan,) = plan_load(reader.index, target, [rank]).ranks
    out = {
        (p.tensor, p.box): torch.empty(
            p.box.shape, dtype=dtypes.to_torch(reader.index.tensors[p.tensor].dtype), device=dev
        )
        for p in rank_plan.pieces
    }
    options = LoadOptions(fill_threads=args.threads)
    result: dict = {"case": args.case, "warm": args.warm, "threads": args.threads, "device": str(dev)}
    warm = result["warm_s"] = {}
    if args.warm == "pin":
        warm["pin_16x16MiB"] = timed(
            lambda: [torch.empty(16 << 20, dtype=torch.uint8, pin_memory=gpu) for _ in range(16)]
        )
    elif args.warm == "streams" and gpu:

        def one() -> None:
            torch.cuda.set_stream(torch.cuda.Stream(dev))
            torch.cuda.Event().record()

        def streams() -> None:
            threads = [threading.Thread(target=one) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        warm["streams_8_threads"] = timed(streams)
    elif args.warm == "zero":
        warm["zero_destinations"] = timed(lambda: [t.zero_() for t in out.values()])
    elif args.warm == "tiny":
        small = sorted(reader.index.tensors, key=lambda n: reader.index.tensors[n].nbytes)[:3]
        warm["tiny_load"] = timed(
            lambda: load_rank_state(src, target, rank, device=dev, out=out, options=options, tensors=small)
        )
    elif args.warm == "cpu":
        warm["cpu_load"] = timed(lambda: load_rank_state(src, target, rank, options=options))
    elif args.warm == "h2d" and gpu:
        host = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
        on_dev = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
        warm["h2d_4GiB"] = [timed(lambda: on_dev.copy_(host, non_blocking=True)) for _ in range(2)]
        del host, on_dev
    elif args.warm == "raw":
        files = data_files(src)
        total = sum(os.path.getsize(f) for f in files)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=gpu)
        on_dev = torch.empty(total, dtype=torch.uint8, device=dev) if gpu else host
        warm["raw"] = [timed(lambda: raw_read(files, host, on_dev, len(os.sched_getaffinity(0)))) for _ in range(2)]
        del host, on_dev
    result["loads_s"] = [
        timed(lambda: load_rank_state(src, target, rank, device=dev, out=out, options=options))
        for _ in range(args.loads)
    ]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
