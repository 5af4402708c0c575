"""Where one training step's time goes: our ZAYA module against transformers' ``ZayaForCausalLM`` (issue 8).

Builds both models with the same weights (as ``bench_model_gpu.py`` does), runs warm-up steps, then profiles
``--steps`` training steps (forward, backward, fused AdamW) of each with ``torch.profiler`` and prints the
``key_averages`` table sorted by device time (or CPU time on a CPU-only machine), plus the number of kernels
launched and of host-device synchronisations (``cudaStreamSynchronize`` / ``cudaMemcpy`` device-to-host) per step.

Runs on CPU too (small batch) to count operators without a GPU:
``python benchmarks/profile_model_gpu.py --device cpu --preset zaya-tiny --batch 2 --seq 64``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from zaya_pair import build_pair, fused_adamw, train_step  # benchmarks/ is on sys.path when a script here runs


def profile_step(name: str, step, dev: torch.device, steps: int, rows: int, out_dir: str | None) -> dict:
    """Profile ``steps`` steps after three warm-up steps; print the table (or write it to ``out_dir``)."""
    import time

    cuda = dev.type == "cuda"
    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = events.table(sort_by=sort, row_limit=rows, max_name_column_width=60)
    count = {}
    for e in events:
        count[e.key] = count.get(e.key, 0) + e.count
    summary = {
        "wall_ms_per_step_profiled": wall * 1e3,
        # kernels only (device-side events): operator rows repeat their kernels' time
        "device_ms_per_step": sum(
            e.self_device_time_total for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation
        )
        / steps
        / 1e3,
        "kernels_per_step": sum(
            count.get(k, 0) for k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
        )
        / steps,
        "syncs_per_step": sum(
            count.get(k, 0) for k in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
        )
        / steps,
        "memcpy_per_step": sum(count.get(k, 0) for k in ("cudaMemcpyAsync", "cudaMemcpy")) / steps,
        "aten_ops_per_step": sum(v for k, v in count.items() if k.startswith("aten::")) / steps,
    }
    line = f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items())
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        safe = "".join(c if c.isalnum() else "_" for c in name)
        with open(os.path.join(out_dir, f"profile_{safe}.txt"), "w") as f:
            f.write(f"{line}\n\n{table}\n")
    else:
        print(f"\n===== {name}: {steps} step(s), sorted by {sort} =====\n{table}", flush=True)
    print(line, flush=True)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="zaya-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="folder for the full tables")
    ap.add_argument("--only", choices=["ours", "transformers"], default=None)
    ap.add_argument("--ours-layouts", default="", help="CCA conv layouts to profile ours with (default: the model's)")
    args = ap.parse_args()

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ours, hf, cfg = build_pair(args.preset, dev, dtype)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    if args.only != "transformers":
        from moeckpt.trainer.models.zaya import model as zaya_model

        default = zaya_model.CCAProjection.conv_layout
        for layout in args.ours_layouts.split(",") if args.ours_layouts else [default]:
            zaya_model.CCAProjection.conv_layout = layout
            label = "ours" if layout == default else f"ours conv {layout}"
            profile_step(
                label, train_step(lambda: ours.loss(ids), fused_adamw(ours)), dev, args.steps, args.rows, args.out
            )
        zaya_model.CCAProjection.conv_layout = default
    if args.only != "ours":
        profile_step(
            "transformers",
            train_step(lambda: hf(input_ids=ids, labels=ids).loss, fused_adamw(hf)),
            dev,
            args.steps,
            args.rows,
            args.out,
        )


if __name__ == "__main__":
    main()
