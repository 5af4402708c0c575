"""What a restarted worker pays for its memory ring on one GPU: mapping and registering surviving slot files, and
whether that registration slows the load and the first step running beside it.

A restarted worker maps the ring's slot files that survived it in ``/dev/shm`` and registers them as pinned memory
(``cudaHostRegister``) in a thread while the model is built and the checkpoint loaded. On the H200 the load took
2.7-3.2 s where a warm load of the same bytes takes about 1 s, and the first step 1.0-1.3 s. This probe measures,
each in a fresh process over the same surviving files:

* ``register``: seconds to map and register each slot: a plain mapping (the page tables filled by the registration
  itself), a mapping made with ``MAP_POPULATE`` (the kernel fills them in one pass first);
* ``beside``: a load-shaped workload (threads copying 16 MiB parts host-to-device out of pinned staging buffers,
  the loader's pattern) alone, then while another thread registers the slots (plain and populated mappings);
* ``straddle``: a device-to-host copy into a range made of two adjacent registrations (a slot registered in parts):
  whether it still runs at the pinned rate.

    python3 benchmarks/probe_ring_restart_gpu.py --gb 6.46 --slots 3 --out docs/benchmarks/gpu   # one GPU
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time

import torch

PART = 16 << 20


def _map(path: str, n: int, populate: bool) -> tuple[mmap.mmap, torch.Tensor, float]:
    t = time.perf_counter()
    fd = os.open(path, os.O_RDWR)
    try:
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        mm = mmap.mmap(fd, n, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8), round(time.perf_counter() - t, 3)


def _register(ptr: int, n: int) -> float:
    t = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(ptr, n, 0))
    if code:
        raise RuntimeError(f"cudaHostRegister returned {code}")
    return round(time.perf_counter() - t, 3)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _load_like(total: int, threads: int) -> float:
    """Seconds for ``threads`` threads to copy ``total`` bytes host-to-device in 16 MiB parts, each from a pinned
    staging buffer of its own into a device buffer (the loader's pattern)."""
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    stages = [torch.empty(PART, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(threads)]
    parts = list(range(0, total, PART))

    def run(k: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for a in parts[k::threads]:
                b = min(a + PART, total)
                dst[a:b].copy_(stages[k][: b - a], non_blocking=True)
                stream.synchronize()

    torch.cuda.synchronize()
    t = time.perf_counter()
    ths = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    torch.cuda.synchronize()
    return round(time.perf_counter() - t, 3)


def _d2h(dst: torch.Tensor, src: torch.Tensor, reps: int = 3) -> list[float]:
    """Seconds of each of ``reps`` device-to-host copies of ``src`` into ``dst``."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t, 4))
    return times


def child(paths: list[str], n: int, case: str, threads: int) -> dict:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    out: dict = {}
    if case == "register":
        for populate in (False, True):
            maps, regs, mapped = [], [], []
            for p in paths:
                mm, base, s = _map(p, n, populate)
                mapped.append(s)
                regs.append(_register(base.data_ptr(), n))
                maps.append((mm, base))
            out["populate" if populate else "plain"] = {"map_s": mapped, "register_s": regs}
            for mm, base in maps:
                _unregister(base.data_ptr())
                del base
                mm.close()
    elif case.startswith("beside"):
        populate = case == "beside_populated"
        total = n
        alone = [_load_like(total, threads) for _ in range(2)]
        maps = [_map(p, n, populate) for p in paths]
        done: list[float] = []

        def register_all() -> None:
            t = time.perf_counter()
            for _, base, _ in maps:
                _register(base.data_ptr(), n)
            done.append(round(time.perf_counter() - t, 3))

        th = threading.Thread(target=register_all)
        th.start()
        with_reg = _load_like(total, threads)
        th.join()
        out = {"load_alone_s": alone, "load_beside_register_s": with_reg, "register_all_s": done[0]}
        for mm, base, _ in maps:
            _unregister(base.data_ptr())
            del base
            mm.close()
    elif case == "straddle":
        mm, base, _ = _map(paths[0], n, True)
        half = (n // 2) // 4096 * 4096
        ptr = base.data_ptr()
        _register(ptr, half)
        _register(ptr + half, n - half)
        src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(5)
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out = {"d2h_two_registrations_s": _d2h(base, src), "d2h_host_alloc_s": _d2h(pinned, src)}
        _unregister(ptr)
        _unregister(ptr + half)
        del base
        mm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=6.46, help="bytes per slot, in GB (zaya-small + AdamW: 6.46)")
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--threads", type=int, default=8, help="the load-shaped workload's threads (the fill threads)")
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = int(args.gb * 1e9) // 4096 * 4096
    if args.child:
        case, paths = args.child[0], args.child[1:]
        print(json.dumps(child(paths, n, case, args.threads)))
        return
    paths = [os.path.join(args.dir, f"moeckpt-probe-ring-{k}") for k in range(args.slots)]
    t = time.perf_counter()
    for p in paths:  # the files a previous process left: written once, then this process exits
        with open(p, "wb") as f:
            f.truncate(n)
            os.posix_fallocate(f.fileno(), 0, n)
    res: dict = {"bytes_per_slot": n, "slots": args.slots, "gpu": torch.cuda.get_device_name(), "cases": {}}
    res["files_s"] = round(time.perf_counter() - t, 3)
    try:
        for case in ("register", "beside_plain", "beside_populated", "straddle"):
            cmd = [sys.executable, __file__, "--gb", str(args.gb), "--threads", str(args.threads), "--child", case]
            done = subprocess.run(cmd + paths, capture_output=True, text=True, check=False)
            last = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
            res["cases"][case] = json.loads(last[0]) if last else {"error": done.stderr[-2000:]}
            print(case, json.dumps(res["cases"][case]), flush=True)
    finally:
        for p in paths:
            os.unlink(p)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_ring_restart_gpu.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
