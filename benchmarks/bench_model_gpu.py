"""Training throughput of a GPU-sized ZAYA (issue 8): our module against transformers' ``ZayaForCausalLM``.

Same config, same weights, same batch, same GPU, bf16 parameters, ``torch.optim.AdamW(fused=True)`` for both, so
the difference is the model code: one training step = forward + backward + optimizer step. Our experts run with
``torch._grouped_mm`` where the build has it, and with the per-expert loop fallback, both measured.

MFU counts 6 FLOPs per active parameter per token (the one routed expert of each layer, not all of them) plus the
attention score and value matmuls (12 * layers * seq * q_dim per token, forward and backward), against the
H200's dense bf16 peak of 989 TFLOP/s.

Timing: each run keeps its model and optimizer; ``--rounds`` rounds each time ``--steps`` steps of every run in
turn (ours, ours' loop fallback, transformers, ...), so slow drift of the GPU's clocks hits all runs alike; the
figure is the median over all timed steps of a run. ``--conv-layouts`` adds runs of ours with the CCA convolutions
in other layouts. Before timing, a CUDA check compares the grouped and loop expert paths (outputs and
gradients, with tokens for the skip expert) on the GPU, where the grouped matmul's unwritten rows are real.

Usage: ``python benchmarks/bench_model_gpu.py --preset zaya-small --batch 8 --seq 1024 --out docs/benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from zaya_pair import build_pair, fused_adamw, train_step  # benchmarks/ is on sys.path when a script here runs

PEAK_BF16_FLOPS = 989e12


def _active_params(cfg) -> tuple[int, int]:
    from moeckpt.trainer.models.zaya.plan import param_specs

    total = active = 0
    for p in param_specs(cfg):
        n = 1
        for s in p.shape:
            n *= s
        total += n
        if ".mlp.experts." in p.name:
            active += n // cfg.num_experts  # top-1: one expert's weights touch each token
        elif p.name != "model.embed_tokens.weight":
            active += n
    active += cfg.vocab_size * cfg.hidden_size  # the tied head is a matmul; the lookup is not
    return total, active


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_steps(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        _sync()
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return times


def _set_experts(model, impl: str) -> None:
    for m in model.modules():
        if hasattr(m, "implementation"):
            m.implementation = impl


def check_experts_on_gpu(dev: torch.device) -> dict:
    """Grouped vs loop experts on the GPU in fp32: max |difference| of outputs and of every gradient."""
    from moeckpt.trainer.models.layers import Experts

    torch.manual_seed(1)
    ex = Experts(16, 256, 128).to(dev)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.05)
        ex.down_proj.normal_(0, 0.05)
    x = torch.randn(4096, 256, device=dev)
    index = torch.randint(0, 17, (4096, 1), device=dev)  # id 16 = a skip expert no one holds
    weights = torch.rand(4096, 1, device=dev)
    got = {}
    for impl in ("loop", "grouped"):
        ex.implementation = impl
        ex.zero_grad()
        xg, wg = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = ex(xg, index, wg)
        out.square().sum().backward()
        got[impl] = [out, xg.grad, wg.grad, ex.gate_up_proj.grad, ex.down_proj.grad]
    diffs = [float((a - b).detach().abs().max()) for a, b in zip(got["loop"], got["grouped"])]
    finite = all(bool(torch.isfinite(t).all()) for t in got["grouped"])
    return {"max_abs_diff": max(diffs), "finite": finite}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="zaya-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conv-layouts", default="", help="extra CCA conv layouts of ours to time, comma-separated")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (tiny presets), no figures")
    args = ap.parse_args()

    import transformers

    from moeckpt.trainer.models.layers import grouped_mm_available
    from moeckpt.trainer.models.zaya import model as zaya_model

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    ours, hf, cfg = build_pair(args.preset, dev, torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    tokens = args.batch * args.seq
    total, active = _active_params(cfg)
    flops_per_token = 6 * active + 12 * cfg.num_hidden_layers * args.seq * cfg.num_attention_heads * cfg.head_dim

    results = {
        "preset": args.preset,
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "params_total": total,
        "params_active": active,
        "grouped_mm_available": grouped_mm_available(dev, torch.bfloat16),
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "transformers": transformers.__version__,
        "transformers_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "transformers_attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "conv_layout_default": zaya_model.CCAProjection.conv_layout,
        "runs": {},
    }
    with torch.no_grad():
        results["loss_ours"] = float(ours.loss(ids))
        results["loss_transformers"] = float(hf(input_ids=ids, labels=ids).loss)

    if dev.type == "cuda":
        results["experts_check"] = check_experts_on_gpu(dev)
        print("experts grouped vs loop on GPU:", results["experts_check"], flush=True)

    default_layout = zaya_model.CCAProjection.conv_layout
    runs = {}  # name -> (model, loss_fn, setup)

    def ours_run(impl: str, layout: str):
        def setup():
            _set_experts(ours, impl)
            zaya_model.CCAProjection.conv_layout = layout

        return ours, lambda: ours.loss(ids), setup

    runs["moeckpt (grouped_mm)"] = ours_run("auto", default_layout)
    runs["moeckpt (loop fallback)"] = ours_run("loop", default_layout)
    for layout in filter(None, args.conv_layouts.split(",")):
        if layout != default_layout:
            runs[f"moeckpt (grouped_mm, conv {layout})"] = ours_run("auto", layout)
    runs["transformers ZayaForCausalLM"] = (hf, lambda: hf(input_ids=ids, labels=ids).loss, lambda: None)

    opts = {id(m): fused_adamw(m) for m in (ours, hf)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    peak: dict[str, float] = dict.fromkeys(runs, 0.0)

    for r in range(args.rounds):
        for name, (model, loss_fn, setup) in runs.items():
            setup()
            step = train_step(loss_fn, opts[id(model)])
            _time_steps(step, 3)  # warm-up: kernels, allocator, optimizer state, after switching runs
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times[name] += _time_steps(step, args.steps)
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 1e9)
            print(f"round {r} {name}: median so far {sorted(times[name])[len(times[name]) // 2]:.4f} s", flush=True)
    _set_experts(ours, "auto")
    zaya_model.CCAProjection.conv_layout = default_layout
    for name, ts in times.items():
        ts = sorted(ts)
        med = ts[len(ts) // 2]
        results["runs"][name] = {
            "step_s_median": med,
            "step_s_min": ts[0],
            "step_s_max": ts[-1],
            "steps_timed": len(ts),
            "tokens_per_s": tokens / med,
            "mfu": tokens / med * flops_per_token / PEAK_BF16_FLOPS,
            "peak_mem_gb": peak[name],
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
    base = results["runs"]["transformers ZayaForCausalLM"]["tokens_per_s"]
    results["speedup_vs_transformers"] = {k: v["tokens_per_s"] / base for k, v in results["runs"].items()}
    print(json.dumps(results["speedup_vs_transformers"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model_throughput.json"), "w") as f:
        json.dump(results, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3))
    names = list(results["runs"])
    colors = ["#d62728" if n.startswith("transformers") else "#1f77b4" for n in names]
    ax.barh(names, [results["runs"][n]["tokens_per_s"] / 1e3 for n in names], color=colors)
    for i, n in enumerate(names):
        ax.text(
            results["runs"][n]["tokens_per_s"] / 1e3, i, f" MFU {results['runs'][n]['mfu'] * 100:.1f}%", va="center"
        )
    ax.set_xlabel("thousand tokens/s (fwd+bwd+AdamW)")
    ax.set_title(f"{args.preset} training step, batch {args.batch}x{args.seq}, bf16, {results['gpu']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "model_throughput.png"), dpi=110)


if __name__ == "__main__":
    main()
