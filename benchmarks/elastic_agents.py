"""The elastic drill on torchrun's elastic agent, with its loss curve (issue 7).

Two nodes (``moeckpt train --nnodes 1:2 --rdzv-endpoint 127.0.0.1:PORT``, 2 CPU workers each) train zaya-tiny;
node B is killed outright at step 17 (agent and workers), node A carries on alone after resuming from the
checkpoint of step 15 resharded to dp 2, node C joins and the world grows back to 4 (resharded again). Writes
``elastic_agents.json`` (records and timeline) and ``elastic_agents.png`` under ``--out``.

Usage: ``python benchmarks/elastic_agents.py --out docs/benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile

import torch

from moeckpt.trainer.elastic_drill import plot_drill, run_shrink_grow_drill


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--kill-at", type=int, default=17)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="moeckpt-elastic-")
    run = os.path.join(work, "run")
    train_args = ["--model", "zaya-tiny", "--run-dir", run, "--steps", str(args.steps), "--save-every", "5",
                  "--ep", "2", "--seed", "1", "--warmup-steps", "3", "--cpu", "--hang-timeout", "60",
                  "--inject", "slow:step=1,seconds=0.15"]
    result = run_shrink_grow_drill(run, train_args, nproc=2, kill_at_step=args.kill_at, progress=print)
    print("worlds (first step, workers):", result.worlds(), "exit codes:", result.exit_codes)
    os.makedirs(args.out, exist_ok=True)
    doc = {
        "command": "python benchmarks/elastic_agents.py --out " + args.out,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "train_args": [a if a != run else "RUN_DIR" for a in train_args],
        "timeline": result.timeline,
        "worlds": result.worlds(),
        "exit_codes": result.exit_codes,
        "records": result.records,
    }
    with open(os.path.join(args.out, "elastic_agents.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot_drill(result, os.path.join(args.out, "elastic_agents.png"))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
