"""How the zarr chunk codec scales with threads: the C entry points called through ctypes (off the interpreter
lock) against numcodecs' and google_crc32c's bindings, side by side in one run (issue 32 item 3).

Encodes and decodes ``--gb`` of bf16 and fp32 values shaped like trained weights (normal, std 0.02) in the 1 MiB
inner chunks a checkpoint stores, each chunk as moeckpt writes it (crc32c, blosc-zstd, crc32c) and read back
(both checksums verified, placed into a tensor), over the codec pool at each thread count, with each codec path.
Every repetition is reported (GB/s of raw bytes, wall); ``--out`` gets ``codec_threads.json``.

    python benchmarks/bench_codec_threads.py --gb 1 --threads 1,2,4,8,16 --reps 3 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import torch

from moeckpt.formats.backends import chunk_codec
from moeckpt.formats.backends import zarr_cells as cells

CHUNK = 1 << 20


def make_chunks(gb: float) -> list[tuple[np.ndarray, int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    per = int(gb * 1e9) // 2
    for dtype, item in ((torch.bfloat16, 2), (torch.float32, 4)):
        t = (torch.randn(per // item, generator=g) * 0.02).to(dtype)
        raw = t.view(torch.uint8).numpy()
        out += [(raw[i : i + CHUNK], item) for i in range(0, raw.nbytes - CHUNK + 1, CHUNK)]
    return out


def run(chunks: list[tuple[np.ndarray, int]], threads: int) -> tuple[float, float]:
    chunk_codec.codec_threads = lambda: threads  # type: ignore[assignment]  # the pool size under test
    chunk_codec._pool = None
    total = sum(c.nbytes for c, _ in chunks)
    t0 = time.perf_counter()
    frames = list(chunk_codec.codec_map(lambda c: cells.compress_chunk(c[0].data, c[1]), chunks))
    enc = time.perf_counter() - t0
    dest = np.ones(total, dtype=np.uint8)  # touched: its page faults are not timed
    stored = [bytes(frame) + bytes(crc) for frame, crc in frames]  # each chunk as a read returns it

    def decode(k: int) -> None:
        buf = stored[k]
        raw = cells._decode_chunk(buf, 0, len(buf), CHUNK, _Ref, "bench", f"chunk {k}")
        dest[k * CHUNK : (k + 1) * CHUNK] = raw[:CHUNK]

    t0 = time.perf_counter()
    list(chunk_codec.codec_map(decode, range(len(frames))))
    dec = time.perf_counter() - t0
    if chunk_codec._pool is not None:
        chunk_codec._pool.shutdown()
    return total / enc / 1e9, total / dec / 1e9


class _Ref:  # what an error message names: a stand-in for the piece reference
    tensor = "bench"

    class box:
        @staticmethod
        def to_json():
            return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    chunks = make_chunks(a.gb)
    results: dict = {"gb": a.gb, "cores": os.cpu_count(), "host": platform.node(), "runs": []}
    run(chunks[:64], 2)  # untimed: the first use of every path (self-tests, allocator)
    for native in ("1", "0"):
        os.environ["MOECKPT_NATIVE_CODEC"] = native
        chunk_codec._native = None
        path = "ctypes" if chunk_codec.uses_native()["blosc"] else "bindings"
        for n in (int(x) for x in a.threads.split(",")):
            for rep in range(a.reps):
                enc, dec = run(chunks, n)
                results["runs"].append(
                    {"path": path, "threads": n, "rep": rep + 1, "encode_gbs": enc, "decode_gbs": dec}
                )
                print(
                    f"{path:8s} threads {n:2d} rep {rep + 1}: encode {enc:6.2f} GB/s  decode {dec:6.2f} GB/s",
                    flush=True,
                )
    if a.out:
        with open(os.path.join(a.out, "codec_threads.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
