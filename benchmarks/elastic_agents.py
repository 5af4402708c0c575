"""The elastic drill on torchrun's elastic agent, with its loss curve (issue 7).

Two nodes (``moeckpt train --nnodes 1:2 --rdzv-endpoint 127.0.0.1:PORT``, 2 CPU workers each) train zaya-tiny;
node B is killed outright at step 17 (agent and workers), node A carries on alone after resuming from the
checkpoint of step 15 resharded to dp 2, node C joins and the world grows back to 4 (resharded again). Writes
``elastic_agents.json`` (records and timeline) and ``elastic_agents.png`` under ``--out``.

Usage: ``python benchmarks/elastic_agents.py --out docs/benchmarks``.

With ``--gpus`` each node is one worker on a GPU of its own (node A on GPU 0, nodes B and C on GPU 1, NCCL), the
model GPU-sized (``--model zaya-small --dtype bf16``) and ``--ep auto`` so each world takes the widest expert
parallelism it can (ep 2 on 2 GPUs, 1 on one); output ``elastic_agents_gpu.{json,png}``::

    python benchmarks/elastic_agents.py --gpus --out docs/benchmarks/gpu
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile

import torch

from moeckpt.trainer.elastic_drill import (
    CPU_DRILL_KILL_AT,
    CPU_DRILL_STEPS,
    DrillResult,
    cpu_drill_args,
    plot_drill,
    run_shrink_grow_drill,
)


def _plot(result: DrillResult, path: str, train_args: list[str], gpus: bool) -> None:
    model = train_args[train_args.index("--model") + 1]
    plot_drill(
        result,
        path,
        title=f"{model} under torchrun elastic agents ({'GPUs, NCCL' if gpus else 'CPU, gloo'}): "
        f"node lost at step {result.kill_step()}, node joins later",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--gpus", action="store_true", help="one worker per node, each node on its own GPU (2 GPUs)")
    ap.add_argument("--steps", type=int, default=None, help="default 80 (CPU) or 60 (GPU)")
    ap.add_argument("--kill-at", type=int, default=CPU_DRILL_KILL_AT)
    ap.add_argument("--model", default=None, help="default zaya-tiny (CPU) or zaya-small (GPU)")
    ap.add_argument("--slow", type=float, default=0.15, help="straggler delay per step, seconds")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the figure of an earlier run's JSON")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            doc = json.load(f)
        _plot(
            DrillResult.from_json(doc),
            args.replot[: -len(".json")] + ".png",
            doc["train_args"],
            "--gpus" in doc["command"],
        )
        return
    work = tempfile.mkdtemp(prefix="moeckpt-elastic-")
    run = os.path.join(work, "run")
    if args.gpus:
        steps, model, nproc, name = args.steps or 60, args.model or "zaya-small", 1, "elastic_agents_gpu"
        extra = [
            "--ep",
            "auto",
            "--dtype",
            "bf16",
            "--global-batch",
            "16",
            "--seq-len",
            "512",
            "--lr",
            "1e-3",
            "--save-every",
            "10",
            "--hang-timeout",
            "30",
        ]
        node_env = lambda node: {"CUDA_VISIBLE_DEVICES": "0" if node == "A" else "1"}  # noqa: E731
        train_args = [
            "--model",
            model,
            "--run-dir",
            run,
            "--steps",
            str(steps),
            "--seed",
            "1",
            "--warmup-steps",
            "3",
            *extra,
            "--inject",
            f"slow:step=1,seconds={args.slow}",
        ]
    else:
        nproc, name, node_env = 2, "elastic_agents", None
        train_args = cpu_drill_args(
            run,
            steps=args.steps or CPU_DRILL_STEPS,
            model=args.model or "zaya-tiny",
            slow=args.slow,
            kill_at=args.kill_at,
        )
    result = run_shrink_grow_drill(
        run, train_args, nproc=nproc, kill_at_step=args.kill_at, timeout_s=540, node_env=node_env, progress=print
    )
    print("worlds (first step, workers):", result.worlds(), "exit codes:", result.exit_codes)
    os.makedirs(args.out, exist_ok=True)
    doc = {
        "command": "python benchmarks/elastic_agents.py " + ("--gpus " if args.gpus else "") + "--out " + args.out,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", 2 x {torch.cuda.get_device_name(0)}" if args.gpus else ""),
        "train_args": [a if a != run else "RUN_DIR" for a in train_args],
        "timeline": result.timeline,
        "worlds": result.worlds(),
        "exit_codes": result.exit_codes,
        "records": result.records,
    }
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    _plot(result, os.path.join(args.out, f"{name}.png"), doc["train_args"], args.gpus)
    if result.exit_codes != {"A": 0, "C": 0}:
        print("\n".join(f"--- node {n}\n{t[-3000:]}" for n, t in result.logs.items()))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
