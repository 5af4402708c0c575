"""Probe (one GPU): host-to-device copies straight from the page cache, against the raw read.

A file in the page cache is mapped read-only and shared, each part of it registered with the device runtime
(``cudaHostRegister`` with the read-only flag: page-locked without a write fault), copied to the GPU from there
on a stream of the part's thread, then unregistered; optionally each part is hashed (xxh3) on the CPU from the
mapping too. The raw read beside it is what ``bench_load_gpu.py`` calls raw: threads ``pread`` the file into
pinned memory, then one copy. A staged load moves each byte through host memory four times (the kernel's copy
into the pinned buffer reads and writes it, the hash reads it, the DMA reads it); from a registered mapping it is
twice (the hash and the DMA read the page cache itself). The question this answers: does the driver take
page-cache pages, and how fast. Thread-seconds of each step are summed over the threads.

    python3 benchmarks/probe_registered_mapping.py --gb 4 --reps 3    # writes /tmp/probe_reg.bin, removes it
    python3 benchmarks/probe_registered_mapping.py --gb 4 --reps 3 --grid 8:64:h,8:64:hp   # one mapping or one per part
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

PATH = "/tmp/probe_reg.bin"
READ_ONLY = 8  # cudaHostRegisterReadOnly


def make_file(n: int) -> None:
    if os.path.exists(PATH) and os.path.getsize(PATH) == n:
        return
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
    with open(PATH, "wb") as f:
        for i in range(0, n, len(block)):
            f.write(block[: min(len(block), n - i)])


def warm() -> None:
    with open(PATH, "rb") as f:
        while f.read(256 << 20):
            pass


def raw(fd: int, n: int, pinned: torch.Tensor, dev: torch.Tensor, threads: int) -> float:
    t = time.perf_counter()
    view = pinned.numpy()
    step = 64 << 20

    def read(off: int) -> None:
        os.preadv(fd, [view[off : off + step].data], off)

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, range(0, n, step)))
    dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def mapped(
    fd: int, n: int, dev: torch.Tensor, threads: int, part_mib: int, hash_cpu: bool, per_part: bool = False
) -> tuple[float, dict]:
    """``per_part``: each part mapped on its own, hashed before it is registered, unmapped after (what the load's
    page-locked path does), instead of one mapping of the whole file registered part by part."""
    cudart = torch.cuda.cudart()
    t = time.perf_counter()
    mm = mmap.mmap(fd, n, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
    base = np.frombuffer(mm, dtype=np.uint8, count=1).ctypes.data  # the mapping's address (the view is dropped)
    part = part_mib << 20
    stats = {"map": 0.0, "register": 0.0, "copy": 0.0, "hash": 0.0, "unregister": 0.0}
    lock = threading.Lock()
    local = threading.local()

    def thread_stream() -> torch.cuda.Stream:
        if getattr(local, "stream", None) is None:
            local.stream = torch.cuda.Stream()
        return local.stream

    def one_per_part(off: int) -> None:
        length = min(part, n - off)
        stream = thread_stream()
        a = time.perf_counter()
        pm = mmap.mmap(fd, length, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED, offset=off)
        address = np.frombuffer(pm, dtype=np.uint8, count=1).ctypes.data
        b = time.perf_counter()
        if hash_cpu:
            xxhash.xxh3_64_intdigest(np.frombuffer(pm, dtype=np.uint8, count=length))
        c = time.perf_counter()
        err = cudart.cudaHostRegister(address, length, READ_ONLY)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        d = time.perf_counter()
        host = torch.frombuffer(pm, dtype=torch.uint8, count=length)
        with torch.cuda.stream(stream):
            dev[off : off + length].copy_(host, non_blocking=True)
        stream.synchronize()
        e = time.perf_counter()
        cudart.cudaHostUnregister(address)
        del host
        pm.close()
        f = time.perf_counter()
        with lock:
            stats["map"] += b - a
            stats["hash"] += c - b
            stats["register"] += d - c
            stats["copy"] += e - d
            stats["unregister"] += f - e  # with the unmapping

    def one(off: int) -> None:
        length = min(part, n - off)
        stream = thread_stream()
        a = time.perf_counter()
        err = cudart.cudaHostRegister(base + off, length, READ_ONLY)
        b = time.perf_counter()
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned {err}")
        host = torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=off)
        with torch.cuda.stream(stream):
            dev[off : off + length].copy_(host, non_blocking=True)
        c = time.perf_counter()
        if hash_cpu:
            xxhash.xxh3_64_intdigest(np.frombuffer(mm, dtype=np.uint8, count=length, offset=off))
        d = time.perf_counter()
        stream.synchronize()
        e = time.perf_counter()
        cudart.cudaHostUnregister(base + off)
        f = time.perf_counter()
        with lock:
            stats["register"] += b - a
            stats["copy"] += c - b + e - d
            stats["hash"] += d - c
            stats["unregister"] += f - e

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.frombuffer warns that the mapping is not writable
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(one_per_part if per_part else one, range(0, n, part)))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    mm.close()
    return wall, {k: round(v, 3) for k, v in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--grid",
        type=lambda v: [
            (int(t), int(m), "h" in f, "p" in f) for t, m, f in ((c + "::").split(":")[:3] for c in v.split(","))
        ],
        default="8:64:h,8:64:hp,16:64:h,16:64:hp,8:16:h,8:16:hp",
        help="THREADS:PART_MIB:FLAGS,... (flags: h hashed on the CPU, p each part mapped on its own)",
    )
    args = ap.parse_args()
    n = int(args.gb * 2**30)
    make_file(n)
    warm()
    fd = os.open(PATH, os.O_RDONLY)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    print(torch.cuda.get_device_name(), f"{n / 1e9:.2f} GB", flush=True)
    try:
        dev.zero_()
        mapped(fd, n, dev, 8, 64, False)
    except RuntimeError as e:
        print("a registered mapping failed:", e, flush=True)
        return
    head = torch.from_numpy(np.fromfile(PATH, dtype=np.uint8, count=1 << 20))
    print("copied bytes equal the file's (first MiB):", torch.equal(dev[: 1 << 20].cpu(), head), flush=True)
    for rep in range(args.reps):
        print(f"rep {rep} raw {raw(fd, n, pinned, dev, 16):.3f} s", flush=True)
        for threads, mib, hashed, per_part in args.grid:
            wall, stats = mapped(fd, n, dev, threads, mib, hashed, per_part)
            how = "each part mapped alone" if per_part else "one mapping"
            print(f"  {how}, {threads} threads, {mib} MiB parts, hashed {hashed}: {wall:.3f} s {stats}", flush=True)
    os.close(fd)
    os.remove(PATH)


if __name__ == "__main__":
    main()
