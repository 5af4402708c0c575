"""Training throughput of a GPU-sized ZAYA (issue 8): our module against transformers' ``ZayaForCausalLM``.

Same config, same weights, same batch, same GPU, bf16 parameters, ``torch.optim.AdamW(fused=True)`` for both, so
the difference is the model code: one training step = forward + backward + optimizer step. Our experts run with
``torch._grouped_mm`` where the build has it, and with the per-expert loop fallback, both measured.

MFU counts 6 FLOPs per active parameter per token (the one routed expert of each layer, not all of them) plus the
attention score and value matmuls (12 * layers * seq * q_dim per token, forward and backward), against the
H200's dense bf16 peak of 989 TFLOP/s.

Usage: ``python benchmarks/bench_model_gpu.py --preset zaya-small --batch 8 --seq 1024 --out docs/benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

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


def _time_steps(step, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="zaya-small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args()

    from transformers import ZayaConfig as HfZayaConfig
    from transformers import ZayaForCausalLM as HfZaya

    from moeckpt.trainer.models import resolve_model
    from moeckpt.trainer.models.layers import build_model, grouped_mm_available
    from moeckpt.trainer.models.zaya.hf import to_hf_config

    dev = torch.device("cuda")
    spec = resolve_model(args.preset)
    cfg = spec.config
    torch.manual_seed(0)
    ours = build_model(spec).to(dev, torch.bfloat16)
    hf_doc = to_hf_config(cfg, dtype="bfloat16")
    hf = HfZaya(HfZayaConfig(**{k: v for k, v in hf_doc.items() if k not in ("architectures", "model_type")}))
    hf = hf.to(dev, torch.bfloat16)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise SystemExit(f"state dicts differ: missing {missing[:5]}, unexpected {unexpected[:5]}")
    hf.train()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=dev)
    tokens = args.batch * args.seq
    total, active = _active_params(cfg)
    flops_per_token = 6 * active + 12 * cfg.num_hidden_layers * args.seq * cfg.num_attention_heads * cfg.head_dim

    results = {
        "preset": args.preset,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "params_total": total,
        "params_active": active,
        "grouped_mm_available": grouped_mm_available(dev, torch.bfloat16),
        "runs": {},
    }
    with torch.no_grad():
        results["loss_ours"] = float(ours.loss(ids))
        results["loss_transformers"] = float(hf(input_ids=ids, labels=ids).loss)

    def bench(name: str, model, loss_fn) -> None:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)

        def step():
            loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        _time_steps(step, 3)  # warm-up: kernels, allocator, optimizer state
        torch.cuda.reset_peak_memory_stats()
        times = sorted(_time_steps(step, args.steps))
        med = times[len(times) // 2]
        results["runs"][name] = {
            "step_s_median": med,
            "tokens_per_s": tokens / med,
            "mfu": tokens / med * flops_per_token / PEAK_BF16_FLOPS,
            "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
        print(name, json.dumps(results["runs"][name]), flush=True)
        del opt
        torch.cuda.empty_cache()

    for impl in ("auto", "loop"):
        for m in ours.modules():
            if hasattr(m, "implementation"):
                m.implementation = impl
        bench(f"moeckpt ({'grouped_mm' if impl == 'auto' else 'loop fallback'})", ours, lambda: ours.loss(ids))
    bench("transformers ZayaForCausalLM", hf, lambda: hf(input_ids=ids, labels=ids).loss)
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
    ax.barh(names, [results["runs"][n]["tokens_per_s"] / 1e3 for n in names], color=["#1f77b4", "#6baed6", "#d62728"])
    for i, n in enumerate(names):
        ax.text(results["runs"][n]["tokens_per_s"] / 1e3, i, f" MFU {results['runs'][n]['mfu'] * 100:.1f}%", va="center")
    ax.set_xlabel("thousand tokens/s (fwd+bwd+AdamW)")
    ax.set_title(f"{args.preset} training step, batch {args.batch}x{args.seq}, bf16, {results['gpu']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "model_throughput.png"), dpi=110)


if __name__ == "__main__":
    main()
