"""Device-to-host copies into pinned host memory of several kinds, on one GPU: where a memory-ring save's time goes.

The memory tier's ring (trainer/memory_ring.py) copies the state into ``/dev/shm`` files mapped and registered with
``cudaHostRegister``. On the H200 such a save blocked 2.5-3.8x a bare copy into ``cudaHostAlloc`` memory, and the
first copy into each slot of a process 16-22x (docs/benchmarks/gpu/memory_tier_gpu_pace.md). This probe times the
same bytes copied into each kind of host memory, one case after another in one process (and one case in a fresh
process, as after a restart), so that the cause is measured rather than guessed:

* ``host_alloc``: ``torch.empty(pin_memory=True)`` (the bare copy the targets are measured against);
* ``shm``: a new ``/dev/shm`` file, mapped, zero-filled, registered (what the ring does at its first start);
* ``shm_warm_h2d`` / ``shm_warm_d2h``: the same after a warm-up that reads every page into the device / writes
  every page from the device;
* ``shm_huge``: the mapping advised ``MADV_HUGEPAGE`` before it is filled (transparent huge pages for shmem where
  the kernel allows it: ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``);
* ``anon``: pageable anonymous memory registered;
* ``restart``: a fresh process maps the surviving ``shm`` file and registers it (a restarted worker);
* ``pieces``: the copy in ``--pieces`` parts (a state of many tensors), into ``host_alloc`` and into ``shm``;
* ``beside_hash``: the copy into ``host_alloc`` while ``--hash-threads`` threads hash another buffer (a commit's
  checksums running beside the next save's copy).

    python3 benchmarks/probe_pinned_gpu.py --gb 6.46 --out docs/benchmarks/gpu   # one H200
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import sys
import threading
import time

import torch


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def _meminfo(key: str) -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def copies(dst: torch.Tensor, src: torch.Tensor, reps: int, pieces: int = 1) -> list[float]:
    """Seconds of each of ``reps`` copies of ``src`` into ``dst`` in ``pieces`` parts, ended by a synchronize."""
    n = src.numel()
    cuts = [n * i // pieces for i in range(pieces + 1)]
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for a, b in zip(cuts, cuts[1:]):
            dst[a:b].copy_(src[a:b], non_blocking=True)
        torch.cuda.synchronize()
        out.append(round(time.perf_counter() - t, 4))
    return out


def shm_slot(path: str, n: int, *, huge: bool = False, fresh: bool = True) -> tuple[mmap.mmap, torch.Tensor, float]:
    if fresh:
        with open(path, "wb") as f:
            f.truncate(n)
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    if huge:
        mm.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    t = time.perf_counter()
    if fresh:
        base.zero_()
    return mm, base, round(time.perf_counter() - t, 3)


def register(t: torch.Tensor) -> float:
    s = time.perf_counter()
    code = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if code:
        raise RuntimeError(f"cudaHostRegister returned {code}")
    return round(time.perf_counter() - s, 3)


def unregister(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def warm(host: torch.Tensor, direction: str, chunk: int = 256 << 20) -> float:
    scratch = torch.empty(min(chunk, host.numel()), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for a in range(0, host.numel(), chunk):
        b = min(a + chunk, host.numel())
        if direction == "h2d":
            scratch[: b - a].copy_(host[a:b], non_blocking=True)
        else:
            host[a:b].copy_(scratch[: b - a], non_blocking=True)
    torch.cuda.synchronize()
    return round(time.perf_counter() - t, 3)


def restart_child(path: str, n: int, reps: int, warmup: str) -> None:
    """In a fresh process: map the surviving file, register it, optionally warm it, time the copies."""
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(7)
    mm, base, _ = shm_slot(path, n, fresh=False)
    reg = register(base)
    w = warm(base, warmup) if warmup != "none" else 0.0
    got = copies(base, src, reps)
    unregister(base)
    del base
    mm.close()
    print(json.dumps({"register_s": reg, "warm_s": w, "d2h_s": got}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=6.46, help="bytes copied, in GB (zaya-small + AdamW: 6.46)")
    ap.add_argument("--reps", type=int, default=4, help="copies per case (the first is the first into that memory)")
    ap.add_argument("--pieces", type=int, default=1036, help="parts of the 'pieces' case (zaya-small: 1036)")
    ap.add_argument("--hash-threads", type=int, default=8, help="threads hashing beside the 'beside_hash' copy")
    ap.add_argument("--dir", default="/dev/shm", help="where the slot files go")
    ap.add_argument("--out", default="", help="folder for probe_pinned_gpu.json (none: stdout only)")
    ap.add_argument("--child", nargs=2, metavar=("PATH", "WARMUP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    n = int(args.gb * 1e9) // 4096 * 4096
    if args.child:
        restart_child(args.child[0], n, args.reps, args.child[1])
        return
    res: dict = {
        "bytes": n,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "dev_shm_mount": [ln for ln in _read("/proc/mounts").splitlines() if " /dev/shm " in ln],
        "cases": {},
    }
    cases = res["cases"]

    def note(name: str, **kw) -> None:
        cases[name] = kw
        print(name, json.dumps(kw), flush=True)

    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(3)
    t = time.perf_counter()
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    alloc = round(time.perf_counter() - t, 3)
    note("host_alloc", alloc_s=alloc, d2h_s=copies(pinned, src, args.reps), h2d_s=copies(src, pinned, 2))
    note("host_alloc_pieces", d2h_s=copies(pinned, src, args.reps, args.pieces))

    path = os.path.join(args.dir, "moeckpt-probe-slot")
    mm, base, fill = shm_slot(path, n)
    reg = register(base)
    note("shm", fill_s=fill, register_s=reg, d2h_s=copies(base, src, args.reps))
    note("shm_pieces", d2h_s=copies(base, src, args.reps, args.pieces))
    # a second registration of the same pages in this process (the ring reopened)
    unregister(base)
    reg = register(base)
    note("shm_reregistered", register_s=reg, d2h_s=copies(base, src, args.reps))
    unregister(base)
    del base
    mm.close()

    for warmup in ("h2d", "d2h"):
        p = os.path.join(args.dir, f"moeckpt-probe-{warmup}")
        mm2, b2, fill = shm_slot(p, n)
        reg = register(b2)
        w = warm(b2, warmup)
        note(f"shm_warm_{warmup}", fill_s=fill, register_s=reg, warm_s=w, d2h_s=copies(b2, src, args.reps))
        unregister(b2)
        del b2
        mm2.close()
        os.unlink(p)

    before = _meminfo("ShmemHugePages")
    p = os.path.join(args.dir, "moeckpt-probe-huge")
    mm3, b3, fill = shm_slot(p, n, huge=True)
    huge = _meminfo("ShmemHugePages") - before
    reg = register(b3)
    note("shm_huge", fill_s=fill, shmem_huge_bytes=huge, register_s=reg, d2h_s=copies(b3, src, args.reps))
    unregister(b3)
    del b3
    mm3.close()
    os.unlink(p)

    anon = torch.empty(n, dtype=torch.uint8)
    anon.zero_()
    reg = register(anon)
    note("anon", register_s=reg, d2h_s=copies(anon, src, args.reps))
    unregister(anon)
    del anon

    for warmup in ("none", "h2d", "d2h"):
        out = subprocess.run(
            [sys.executable, __file__, "--gb", str(args.gb), "--reps", str(args.reps), "--child", path, warmup],
            capture_output=True,
            text=True,
            check=False,
        )
        last = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
        note(f"restart_warm_{warmup}", **(json.loads(last[0]) if last else {"error": out.stderr[-2000:]}))
    os.unlink(path)

    try:
        import xxhash

        other = torch.empty(n, dtype=torch.uint8).fill_(1)
        raw = memoryview(other.numpy()).cast("B")
        stop = threading.Event()
        done = [0]

        def hasher(k: int) -> None:
            step = 8 << 20
            at = k * step
            while not stop.is_set():
                a = at % (n - step)
                xxhash.xxh3_64_hexdigest(raw[a : a + step])
                done[0] += step
                at += args.hash_threads * step

        threads = [threading.Thread(target=hasher, args=(k,), daemon=True) for k in range(args.hash_threads)]
        for th in threads:
            th.start()
        time.sleep(0.2)
        d0, t0 = done[0], time.perf_counter()
        got = copies(pinned, src, args.reps)
        rate = (done[0] - d0) / (time.perf_counter() - t0) / 1e9
        stop.set()
        for th in threads:
            th.join()
        note("beside_hash", hash_threads=args.hash_threads, hash_gb_s=round(rate, 2), d2h_s=got)
    except ImportError as e:
        note("beside_hash", error=str(e))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "probe_pinned_gpu.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
