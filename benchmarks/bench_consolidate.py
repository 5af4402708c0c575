"""Consolidation benchmark: ``moeckpt consolidate`` of a ``moeckpt.save`` state against ``cp -r`` of the same bytes.

The state (about ``--gb`` GB; no bundled model: plain layers of fp32 matrices, bf16 embeddings, vectors) is saved
by 4 gloo ranks as DTensors on a 2x2 (dp, tp) CPU mesh: FSDP-like ``Shard(0)`` on dp, TP-like ``Shard(1)`` on tp,
replicated vectors. That is source ``mesh2x2`` (runs of rows of a ``Shard(1)`` tensor are assembled from two
pieces). ``moeckpt reshard --dp 4`` of it is source ``dp4`` (every tensor split along dim 0: runs written straight
from the bytes read). For each source, ``--reps`` pairs back to back, page cache dropped before each (when the
machine lets us):

* ``cp -r SRC COPY && sync`` (coreutils 9 copies each file in the kernel, ``copy_file_range``: no byte reaches
  user space, so it is a floor no verifying reader can reach);
* ``dd bs=32M conv=fsync`` of each file of SRC into COPY: the same bytes read into user space and written back;
* ``moeckpt.consolidate(SRC, OUT)`` in a fresh process (it fsyncs each shard), its wall time, its peak RSS
  (``VmHWM``) and the largest run of rows it held (``peak_slab_bytes``).

The baseline RSS is that of a fresh interpreter with torch and the consolidation module imported, nothing done.
After the runs every consolidated tensor is compared bit for bit with the state regenerated from its seed.

    python benchmarks/bench_consolidate.py --gb 1.1 --reps 3       # docs/benchmarks/consolidate.json
    python benchmarks/bench_consolidate.py --gb 0.05 --reps 1      # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def specs(gb: float) -> dict[str, tuple[list[int], str, list[str]]]:
    """``{key: (shape, dtype, placements on the (dp, tp) mesh)}`` of about ``gb`` GB."""
    hidden, ffn, vocab = 2048, 5632, 32768
    per_layer = (2 * hidden * ffn + hidden * hidden) * 4 + hidden * 4
    layers = max(1, round((gb * 1e9 - 2 * vocab * hidden * 2) / per_layer))
    if gb < 0.2:  # a quick check: small widths
        hidden, ffn, vocab, layers = 256, 704, 4096, 4
    out: dict[str, tuple[list[int], str, list[str]]] = {
        "model.embed.weight": ([vocab, hidden], "bfloat16", ["S(0)", "R"]),
        "model.head.weight": ([vocab, hidden], "bfloat16", ["S(0)", "S(1)"]),
    }
    for i in range(layers):
        out[f"model.layers.{i}.w_in"] = ([ffn, hidden], "float32", ["S(0)", "S(1)"])
        out[f"model.layers.{i}.w_out"] = ([hidden, ffn], "float32", ["S(0)", "S(1)"])
        out[f"model.layers.{i}.wq"] = ([hidden, hidden], "float32", ["S(0)", "R"])
        out[f"model.layers.{i}.norm"] = ([hidden], "float32", ["R", "R"])
    return out


def full_value(key: str, shape: list[int], dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(key.encode()) * 7919 + len(key))
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def save_worker(rank: int, path: str, gb: float) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import moeckpt

    mesh = init_device_mesh("cpu", (2, 2))
    sd = {}
    for key, (shape, dtype, placements) in specs(gb).items():
        ps = [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in placements]
        sd[key] = distribute_tensor(full_value(key, shape, dtype), mesh, ps, src_data_rank=None)
    sd["step"] = 100
    moeckpt.save(sd, path)


def settle() -> None:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


CHILD = """
import gc, json, sys
from moeckpt.library.consolidate import consolidate
gc.collect(); gc.freeze()  # as the moeckpt command does after its imports (cli/main.py)
r = consolidate(sys.argv[1], sys.argv[2], max_shard_size=int(sys.argv[3]))
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"s": r.seconds, "bytes": r.total_size, "files": len(r.files), "peak_slab_bytes": r.peak_slab_bytes,
                  "peak_rss_bytes": hwm}))
"""
BASELINE = """
import torch, moeckpt.library.consolidate
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


def runs(src: str, work: str, reps: int, shard: int) -> dict:
    out, copy = os.path.join(work, "hf"), os.path.join(work, "copy")
    results: dict = {"cp": [], "dd": [], "consolidate": []}
    for _ in range(reps):
        for method in ("cp", "dd", "consolidate"):
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(copy, ignore_errors=True)
            settle()
            t0 = time.perf_counter()
            if method == "cp":
                subprocess.run(["cp", "-r", src, copy], check=True)
                subprocess.run(["sync"], check=True)
                results["cp"].append({"s": time.perf_counter() - t0})
            elif method == "dd":  # the same bytes through user space: cp 9 copies in the kernel (copy_file_range)
                os.makedirs(copy)
                for name in sorted(os.listdir(src)):
                    subprocess.run(
                        [
                            "dd",
                            f"if={os.path.join(src, name)}",
                            f"of={os.path.join(copy, name)}",
                            "bs=32M",
                            "conv=fsync",
                            "status=none",
                        ],
                        check=True,
                    )
                results["dd"].append({"s": time.perf_counter() - t0})
            else:
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, src, out, str(shard)], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    raise SystemExit(f"consolidate failed: {proc.stderr}")
                doc = json.loads(proc.stdout)
                doc["wall_with_startup_s"] = time.perf_counter() - t0
                results["consolidate"].append(doc)
            print(method, json.dumps(results[method][-1]), flush=True)
    return results


def check(out: str, gb: float) -> int:
    """Every consolidated tensor against the state regenerated from its seed; returns the tensors compared."""
    from safetensors import safe_open

    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    n = 0
    for key, (shape, dtype, _) in specs(gb).items():
        with safe_open(os.path.join(out, index["weight_map"][key]), "pt") as f:
            got = f.get_tensor(key)
        want = full_value(key, shape, dtype)
        if not (got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))):
            raise SystemExit(f"{key}: consolidated tensor differs from the saved one")
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-shard-size", type=int, default=500 * 10**6)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "benchmarks", "consolidate.json"))
    args = ap.parse_args()
    from moeckpt.trainer.local_world import run_local_world

    work = args.dir or tempfile.mkdtemp(prefix="moeckpt-bench-consolidate-")
    mesh, dp4 = os.path.join(work, "mesh2x2"), os.path.join(work, "dp4")
    shutil.rmtree(mesh, ignore_errors=True)
    shutil.rmtree(dp4, ignore_errors=True)
    t0 = time.perf_counter()
    run_local_world(save_worker, 4, mesh, args.gb, timeout_s=1800)
    print(f"saved {mesh} ({dir_bytes(mesh) / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    subprocess.run([sys.executable, "-m", "moeckpt.cli.main", "reshard", mesh, dp4, "--dp", "4"], check=True)
    base = int(subprocess.run([sys.executable, "-c", BASELINE], capture_output=True, text=True, check=True).stdout)
    doc: dict = {
        "command": " ".join(["python", "benchmarks/bench_consolidate.py", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "gb": args.gb,
        "max_shard_size": args.max_shard_size,
        "baseline_rss_bytes": base,
        "sources": {},
    }
    for name, src in (("mesh2x2", mesh), ("dp4", dp4)):
        print(f"-- {name}: {dir_bytes(src) / 1e9:.3f} GB", flush=True)
        result = runs(src, work, args.reps, args.max_shard_size)
        compared = check(os.path.join(work, "hf"), args.gb)
        doc["sources"][name] = {"source_bytes": dir_bytes(src), "runs": result, "tensors_bit_for_bit": compared}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps(doc, indent=2))
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
