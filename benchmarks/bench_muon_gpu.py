"""Muon against ZeRO-1 AdamW on one GPU (issue 20): optimizer step time, Muon's share of the training step, and the
loss after the same tokens.

For each optimizer, the bundled trainer (``moeckpt.trainer.train.Trainer``, one process, ``--dtype`` parameters
with fp32 masters) trains ``--model`` on the shipped text (or ``--data``) for ``--steps`` steps from the same
initial weights, on the same batches, with the same learning-rate schedule. Every step is timed in two parts with
the device synchronized around each: forward + backward, and ``optimizer.step`` (for Muon: momentum, stacking,
bf16 Newton-Schulz of every matrix, the update; for AdamW the element-wise update). The first ``--warmup`` steps
are left out of the medians.

Reported (``OUT/muon_gpu.json``, ``OUT/muon_gpu_loss.png``): per optimizer the median optimizer-step and
training-step seconds, the optimizer's share of the training step, tokens/s and the loss curve; Muon's optimizer
step over AdamW's; the mean loss of the last ``--tail`` steps of each. Targets: Muon's whole optimizer step <= 10 %
of the training step.

    python benchmarks/bench_muon_gpu.py --model zaya-small --dtype bf16 --steps 200 --seq-len 2048 --out docs/benchmarks/gpu
    python benchmarks/bench_muon_gpu.py --model zaya-tiny --cpu --steps 4 --seq-len 32 --global-batch 4 --out /tmp/m
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(optimizer: str, args, device: torch.device, root: str) -> dict:
    from moeckpt.trainer.train import TrainConfig, Trainer

    cfg = TrainConfig(
        model=args.model,
        run_dir=os.path.join(root, optimizer),
        data=args.data,
        steps=args.steps,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        lr=args.lr,
        warmup_steps=args.warmup_lr,
        dtype=args.dtype,
        optimizer=optimizer,
        seed=args.seed,
        cpu=device.type == "cpu",
        async_save=False,
    )
    trainer = Trainer(cfg, device=device)
    fwd_bwd, opt_s, losses = [], [], []
    try:
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            # --accum micro-batches of --global-batch sequences per optimizer step (gradient accumulation):
            # the optimizer's share depends on the tokens per step, and real runs step on millions of tokens.
            loss_sum = 0.0
            for _ in range(args.accum):
                inputs, targets = trainer.loader.next()
                loss = trainer.loss(inputs, targets) / args.accum
                loss.backward()
                loss_sum += float(loss.detach())
            _sync(device)
            t1 = time.perf_counter()
            trainer.optimizer.step(trainer.schedule.next())
            trainer.optimizer.zero_grad()
            _sync(device)
            t2 = time.perf_counter()
            fwd_bwd.append(t1 - t0)
            opt_s.append(t2 - t1)
            losses.append(loss_sum)
        memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    finally:
        trainer.close()
    timed = slice(min(args.warmup, args.steps - 1), None)
    step = [a + b for a, b in zip(fwd_bwd, opt_s)][timed]
    med_step, med_opt = statistics.median(step), statistics.median(opt_s[timed])
    tokens = args.global_batch * args.seq_len * args.accum
    return {
        "optimizer": optimizer,
        "median_step_s": med_step,
        "median_optimizer_step_s": med_opt,
        "median_forward_backward_s": statistics.median(fwd_bwd[timed]),
        "optimizer_share_of_step": med_opt / med_step,
        "tokens_per_s": tokens / med_step,
        "max_memory_allocated": memory,
        "losses": losses,
        "tail_loss": statistics.fmean(losses[-args.tail :]),
        "muon_params": sum(1 for n in trainer.optimizer._params if trainer.optimizer.rule_of(n) == "muon"),
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    tokens = result["tokens_per_step"]
    for name, r in result["runs"].items():
        xs = [(i + 1) * tokens / 1e6 for i in range(len(r["losses"]))]
        ax.plot(
            xs,
            r["losses"],
            lw=1.2,
            label=f"{name}: last {result['tail']} steps {r['tail_loss']:.3f}, "
            f"optimizer {100 * r['optimizer_share_of_step']:.1f} % of a step",
        )
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("training loss")
    ax.set_title(f"{result['model']} {result['dtype']}, lr {result['lr']}, on {result['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="zaya-small")
    p.add_argument("--data", default=None, help="token file (default: the shipped text)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing medians")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8, help="sequences per forward/backward pass")
    p.add_argument("--accum", type=int, default=1, help="forward/backward passes (micro-batches) per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, the same for both optimizers")
    p.add_argument("--warmup-lr", type=int, default=20, help="learning-rate warmup steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tail", type=int, default=10, help="steps averaged for the final loss")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "muon"], choices=["adamw", "muon"])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (a tiny proof that the script works)")
    p.add_argument("--out", required=True, help="directory for muon_gpu.json and muon_gpu_loss.png")
    args = p.parse_args()
    device = torch.device("cuda") if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    if device.type == "cpu" and not args.cpu:
        raise SystemExit("no GPU visible: pass --cpu to run on the CPU (at a tiny size)")
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-muon-gpu-")
    try:
        runs = {name: run(name, args, device, root) for name in args.optimizers}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "steps": args.steps,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "accum": args.accum,
        "tokens_per_step": args.seq_len * args.global_batch * args.accum,
        "lr": args.lr,
        "warmup_lr": args.warmup_lr,
        "tail": args.tail,
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_muon_gpu.py " + " ".join(os.sys.argv[1:]),
        "runs": runs,
    }
    if {"adamw", "muon"} <= set(runs):
        result["muon_optimizer_step_over_adamw"] = (
            runs["muon"]["median_optimizer_step_s"] / runs["adamw"]["median_optimizer_step_s"]
        )
        result["muon_step_over_adamw"] = runs["muon"]["median_step_s"] / runs["adamw"]["median_step_s"]
    with open(os.path.join(args.out, "muon_gpu.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.join(args.out, "muon_gpu_loss.png"))
    for name, r in runs.items():
        print(
            f"{name}: step {r['median_step_s'] * 1e3:.1f} ms, optimizer {r['median_optimizer_step_s'] * 1e3:.1f} ms "
            f"({100 * r['optimizer_share_of_step']:.1f} %), loss over the last {args.tail} steps {r['tail_loss']:.4f}"
        )
    print(f"wrote {os.path.join(args.out, 'muon_gpu.json')} and muon_gpu_loss.png")


if __name__ == "__main__":
    main()
