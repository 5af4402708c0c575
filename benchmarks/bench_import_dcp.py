"""import-dcp benchmark, side by side in one run on the same DCP checkpoint: moeckpt vs ``cp -r`` and vs torch's own
``dcp_to_torch_save``.

The checkpoint is a torchtitan-named Qwen3-MoE (``qwen3moe-30b-a3b``'s proportions, widened to ``--gb``) with fp32
parameters and AdamW moments (``optimizer.state.<fqn>.exp_avg``...), written by ``dcp.save`` from 4 gloo ranks as
DTensors on a (fsdp 2, tp 2) mesh: ``Shard(0)`` over fsdp, torchtitan's TP splits, one ``__R_0.distcp`` file per
rank. Then, each in a fresh process with the page cache dropped before it and ``--settle`` seconds of quiet
(``--reps`` rounds, median kept):

1. ``cp -r`` of the DCP directory followed by ``sync`` (target: import >= 0.8x its throughput), and the same again
   as a control (``cp_again``: its ratio to the first shows how far the machine alone moves a per-round ratio);
2. ``import-dcp --mapping torchtitan`` into ``--target`` (default tp=2, ep=2, dp=2), safetensors, with its peak RSS
   (``VmHWM``) next to the RSS of the interpreter with torch and moeckpt imported;
3. ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` of the same directory followed by ``sync``
   (target: import >= 1.5x): like the import, which fsyncs every file it writes before it commits, and ``cp -r``,
   the time counts until the output is on disk; the time before the sync is kept too (``s_before_sync``).

Throughput is the DCP directory's bytes over the wall time. Results: ``docs/benchmarks/import_dcp.json`` and
``import_dcp.png``.

    python benchmarks/bench_import_dcp.py --gb 1.07      # the full run
    python benchmarks/bench_import_dcp.py --gb 0.05      # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeckpt.reshard.options import offline_workers
from moeckpt.trainer.interop import torchtitan
from moeckpt.trainer.models import ModelSpec, presets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: "cp_again" is the control: ``cp -r`` a second time in the same round. Its ratio to the first is 1 but for the
#: machine's noise (a virtual disk's throughput moves from second to second), which every per-round ratio carries.
METHODS = ["cp", "moeckpt", "dcp_to_torch_save", "cp_again"]


def scaled_model(gb: float) -> ModelSpec:
    """Qwen3-MoE (4 layers, 8 experts) widened until parameters plus AdamW moments (fp32) reach ``gb``."""
    base = presets()["qwen3moe-tiny"]
    for hidden in range(64, 64 * 1024, 64):
        cfg = replace(
            base.config,
            hidden_size=hidden,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=hidden // base.config.num_attention_heads,
            moe_intermediate_size=hidden // 2,
            vocab_size=4096,
        )
        spec = ModelSpec(base.arch, cfg)
        if 3 * 4 * sum(int(torch.Size(p.shape).numel()) for p in spec.param_specs()) >= gb * 1e9:
            return spec
    raise ValueError(f"--gb {gb} is too large")


def torchtitan_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """torchtitan's names and shapes of the model (moeckpt's export naming)."""
    out = {}
    for p in spec.param_specs():
        for name, box in torchtitan.family(spec.arch, "benchmark").export_names(p.name, tuple(p.shape)):
            out[name] = box.shape
    return out


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    if name.endswith(("w1_EFD", "w3_EFD")):
        return Shard(1)
    if name.endswith("w2_EDF"):
        return Shard(2)
    if name.endswith(("wq.weight", "wk.weight", "wv.weight")) or name == "lm_head.weight":
        return Shard(0)
    if name.endswith("wo.weight"):
        return Shard(1)
    return Replicate()


def write_worker(rank: int, world: int, port: int, gb: float, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("fsdp", "tp"))
    g = torch.Generator().manual_seed(rank)
    state = {}
    for name, shape in torchtitan_tensors(scaled_model(gb)).items():
        place = [Shard(0), _placement(name)]
        local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, place)
        stride = torch.empty(shape, device="meta").stride()
        for key in (name, f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"):
            state[key] = DTensor.from_local(
                torch.randn(local_shape, generator=g),
                mesh,
                place,
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
    state["train_state"] = {"step": 10}
    dcp.save(state, checkpoint_id=path)
    dist.destroy_process_group()


def settle(seconds: float) -> None:
    """Flush and drop the page cache, then wait: a virtual disk keeps writing the previous method's output back
    for a while after the guest's sync returns, on host cores the guest shares."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass
    time.sleep(seconds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


IMPORT_CHILD = """
import json, sys, time
from moeckpt.reshard.layout import Layout
from moeckpt.trainer.interop import DcpImport
from moeckpt.trainer.models import ModelSpec
src, dst, target, model, workers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
job = DcpImport(src, layout=Layout(**target), mapping="torchtitan", model=ModelSpec.from_json(model))
index, read = job.write(dst, workers=workers)
s = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"s": s, "bytes_read": read, "bytes_written": index.nbytes, "peak_rss_bytes": hwm}))
"""
DCP_CHILD = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
t0 = time.perf_counter()
dcp_to_torch_save(sys.argv[1], sys.argv[2])
unsynced = time.perf_counter() - t0
os.sync()  # on disk, as the import (it fsyncs every file before its commit) and cp -r + sync are
s = time.perf_counter() - t0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"s": s, "s_before_sync": unsynced, "peak_rss_bytes": hwm}))
"""
BASELINE_CHILD = """
import torch, moeckpt.trainer.interop
print(next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:")))
"""


def run_once(method: str, args, src: str, spec: ModelSpec) -> dict:
    out = os.path.join(args.dir, "out")
    shutil.rmtree(out, ignore_errors=True)
    if os.path.exists(out + ".pt"):
        os.remove(out + ".pt")
    settle(args.settle)
    t0 = time.perf_counter()
    if method in ("cp", "cp_again"):
        subprocess.run(["cp", "-r", src, out], check=True)
        subprocess.run(["sync"], check=True)
        return {"s": time.perf_counter() - t0}
    if method == "moeckpt":
        cmd = [
            sys.executable,
            "-c",
            IMPORT_CHILD,
            src,
            out,
            json.dumps(parse_layout(args.target)),
            json.dumps(spec.to_json()),
            str(args.workers),
        ]
    else:
        cmd = [sys.executable, "-c", DCP_CHILD, src, out + ".pt"]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise SystemExit(f"{method} failed: {run.stderr[-3000:]}")
    doc = json.loads(run.stdout.strip().splitlines()[-1])
    doc["wall_with_startup_s"] = time.perf_counter() - t0
    return doc


def parse_layout(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["cp -r + sync", "moeckpt import-dcp", "dcp_to_torch_save"]
    vals = [doc["best"][m]["gb_per_s"] for m in METHODS[:3]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, vals, color=["#999999", "#1f77b4", "#d62728"])
    ax.set_ylabel("GB/s (DCP directory bytes / wall time)")
    ax.set_title(f"import of a {doc['dcp_bytes'] / 1e9:.2f} GB torchtitan DCP checkpoint (4 ranks' files)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.07, help="size of the training state (GB)")
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-import-dcp", help="scratch directory (local disk)")
    ap.add_argument("--target", default="tp=2,ep=2,dp=2", help="layout import-dcp writes")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="import-dcp's parallel writers (default: its own, 4 or the machine's cores if fewer)",
    )
    ap.add_argument("--reps", type=int, default=3, help="rounds of the three methods; the median of each is kept")
    ap.add_argument(
        "--settle", type=float, default=2.0, help="seconds to wait after dropping the page cache before each method"
    )
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks"), help="where JSON and PNG go")
    args = ap.parse_args()
    args.workers = offline_workers() if args.workers is None else args.workers
    if args.gb <= 0 or args.reps < 1 or args.workers < 1:
        raise SystemExit("--gb, --reps and --workers must be positive")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    src = os.path.join(args.dir, "dcp")
    spec = scaled_model(args.gb)
    mp.spawn(write_worker, args=(4, free_port(), args.gb, src), nprocs=4)
    size = dir_bytes(src)
    runs: dict[str, list] = {m: [] for m in METHODS}
    for rep in range(args.reps):
        k = rep % len(METHODS)
        order = METHODS[k:] + METHODS[:k]  # each round starts with another method
        for method in order:
            runs[method].append(run_once(method, args, src, spec))
    best = {}
    for m, rs in runs.items():
        r = dict(sorted(rs, key=lambda x: x["s"])[len(rs) // 2])
        r["gb_per_s"] = size / 1e9 / r["s"]
        best[m] = r
    base = subprocess.run([sys.executable, "-c", BASELINE_CHILD], capture_output=True, text=True, check=True)
    doc = {
        "benchmark": "import_dcp",
        "dcp_bytes": size,
        "files": len(os.listdir(src)),
        "target": args.target,
        "workers": args.workers,
        "model": spec.to_json(),
        "reps": args.reps,
        "runs": runs,
        "best": best,
        "baseline_rss_bytes": int(base.stdout),
        "ratio_vs_cp": best["moeckpt"]["gb_per_s"] / best["cp"]["gb_per_s"],
        "ratio_vs_dcp_to_torch_save": best["moeckpt"]["gb_per_s"] / best["dcp_to_torch_save"]["gb_per_s"],
        "per_rep_ratios": {
            "vs_cp": [c["s"] / m["s"] for m, c in zip(runs["moeckpt"], runs["cp"])],
            "vs_dcp_to_torch_save": [d["s"] / m["s"] for m, d in zip(runs["moeckpt"], runs["dcp_to_torch_save"])],
            "control_cp_again_vs_cp": [c["s"] / a["s"] for a, c in zip(runs["cp_again"], runs["cp"])],
        },
        "targets": {"vs_cp": 0.8, "vs_dcp_to_torch_save": 1.5},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "import_dcp.json"), "w") as f:
        json.dump(doc, f, indent=2)
    plot(doc, os.path.join(args.out, "import_dcp.png"))
    print(
        f"DCP checkpoint {size / 1e9:.3f} GB in {doc['files']} files; import-dcp {best['moeckpt']['gb_per_s']:.2f} "
        f"GB/s = {doc['ratio_vs_cp']:.2f}x cp -r (target 0.8x), {doc['ratio_vs_dcp_to_torch_save']:.2f}x "
        f"dcp_to_torch_save (target 1.5x); import peak RSS {best['moeckpt']['peak_rss_bytes'] / 1e6:.0f} MB "
        f"(interpreter alone {doc['baseline_rss_bytes'] / 1e6:.0f} MB)"
    )
    for name, values in doc["per_rep_ratios"].items():
        print(f"{name} per repetition: " + ", ".join(f"{v:.2f}x" for v in values))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
