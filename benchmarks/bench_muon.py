"""Muon against ZeRO-1 AdamW on CPU (issue 20): communication per step, the two exchange schemes, checkpoint cost,
and an elastic drill under Muon.

Parts (``--parts``, all by default):

* **comm**: bytes one optimizer step sends, Muon vs AdamW, counted from the optimizers' own buffers
  (``comm_bytes()``: the reduce-scatter of gradients and the all-gather of parameters as ring collectives move them,
  plus Muon's all-to-alls), for ``--comm-model`` in ``--comm-layouts``, bf16 parameters, summed over every rank and
  the most any rank sends. The optimizers are built on the meta device per rank: no memory, no processes, so this
  counts zaya-small at 16 ranks on a laptop. Target: Muon <= 1.25x AdamW.
* **schemes**: the optimizer step of Muon under ``assign`` and ``gather`` (and AdamW's, for scale) in a gloo world
  of ``--world`` processes on ``--scheme-model``, ``--scheme-layouts``, the two schemes interleaved round by round
  so drift hits both alike; median seconds per step. This picked the default scheme (``trainer/muon.py``).
* **checkpoint**: the real trainer with each optimizer in ``--ckpt-layout`` on ``--ckpt-model``: checkpoint bytes,
  the synchronous save's seconds, and the seconds of the resume that reads it back (fastest of ``--reps``).
* **drill**: ``testing/elastic_drill.py``'s CPU drill (two torchrun agents, one killed, one joining) with
  ``--optimizer muon``: the world goes 4 -> 2 -> 4 workers and the run finishes; its loss curve as a PNG.

Results: ``OUT/muon_cpu.json`` (and ``muon_drill.png``). ``--tiny`` shrinks everything to prove the script works.

    python benchmarks/bench_muon.py --out docs/benchmarks
    python benchmarks/bench_muon.py --tiny --out /tmp/muon-bench
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

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks")
#: a zaya-small shape scaled down so a CPU step takes well under a second.
SCALED_ZAYA = {
    "arch": "zaya",
    "config": {
        "vocab_size": 4096,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "moe_intermediate_size": 256,
        "num_experts": 8,
        "router_hidden_size": 64,
    },
}


def _layout(text: str):
    from moeckpt.reshard.layout import Layout

    tp, ep, dp = (int(x) for x in text.split(","))
    return Layout(tp=tp, ep=ep, dp=dp)


def _model(name: str, root: str) -> str:
    """A preset name, or ``scaled`` written out as a config file."""
    if name != "scaled":
        return name
    path = os.path.join(root, "scaled-zaya.json")
    with open(path, "w") as f:
        json.dump(SCALED_ZAYA, f)
    return path


def _local_params(spec, layout, rank: int, device: str, dtype) -> list[tuple[str, torch.Tensor]]:
    from moeckpt.formats.index import TensorEntry
    from moeckpt.reshard.local import local_shape

    out = []
    for s in spec.param_specs():
        entry = TensorEntry(
            name=s.name, shape=tuple(s.shape), dtype="float32", role="param", param=s.name, sharding=s.rule.to_json()
        )
        shape = local_shape(entry, layout, rank)
        if device == "meta":
            out.append((s.name, torch.empty(shape, dtype=dtype, device="meta")))
        else:
            g = torch.Generator().manual_seed(hash((s.name, rank)) % 2**31)
            out.append((s.name, (torch.randn(shape, generator=g) * 0.02).to(dtype)))
    return out


# ------------------------------------------------------------------------------------------------- comm


def comm(model: str, layouts: list[str]) -> list[dict]:
    from moeckpt.trainer.adamw import ZeroAdamW
    from moeckpt.trainer.models import resolve_model
    from moeckpt.trainer.muon import MuonConfig, ZeroMuon
    from moeckpt.trainer.parallel import ParallelGroups

    spec = resolve_model(model)
    rows = []
    for text in layouts:
        layout = _layout(text)
        spec.check_layout(layout.tp, layout.ep)
        totals: dict[str, list[int]] = {"adamw": [], "assign": [], "gather": []}
        detail: dict[str, dict[str, int]] = {}
        for rank in range(layout.world):
            groups = ParallelGroups(layout=layout, coords=layout.coords(rank), device=torch.device("meta"))
            params = _local_params(spec, layout, rank, "meta", torch.bfloat16)
            opts = {"adamw": ZeroAdamW(params, spec.param_specs(), groups)}
            for scheme in ("assign", "gather"):
                opts[scheme] = ZeroMuon(params, spec.param_specs(), groups, MuonConfig(scheme=scheme))
            for key, opt in opts.items():
                b = opt.comm_bytes()
                totals[key].append(sum(b.values()))
                for k, v in b.items():
                    detail.setdefault(key, {}).setdefault(k, 0)
                    detail[key][k] += v
        adamw = sum(totals["adamw"])
        row = {
            "layout": layout.to_json(),
            "world": layout.world,
            "bytes_per_step_all_ranks": {k: sum(v) for k, v in totals.items()},
            "max_rank_bytes": {k: max(v) for k, v in totals.items()},
            "by_collective": detail,
            "muon_over_adamw": {s: (sum(totals[s]) / adamw if adamw else None) for s in ("assign", "gather")},
        }
        rows.append(row)
        print(
            f"comm {text}: adamw {adamw / 1e6:.1f} MB, muon assign {row['muon_over_adamw']['assign']:.3f}x, "
            f"gather {row['muon_over_adamw']['gather']:.3f}x",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------------------------------------- schemes


def _scheme_worker(rank: int, model: str, layout_text: str, steps: int, warmup: int, threads: int, out: str) -> None:
    import torch.distributed as dist

    from moeckpt.trainer.adamw import ZeroAdamW
    from moeckpt.trainer.models import resolve_model
    from moeckpt.trainer.muon import MuonConfig, ZeroMuon
    from moeckpt.trainer.parallel import build_groups

    torch.set_num_threads(threads)
    spec = resolve_model(model)
    layout = _layout(layout_text)
    groups = build_groups(layout, device=torch.device("cpu"))
    opts = {}
    for key in ("assign", "gather", "adamw"):
        params = _local_params(spec, layout, rank, "cpu", torch.float32)
        opt = (
            ZeroAdamW(params, spec.param_specs(), groups)
            if key == "adamw"
            else ZeroMuon(params, spec.param_specs(), groups, MuonConfig(scheme=key))
        )
        g = torch.Generator().manual_seed(rank)
        for _, t in params:
            t.grad = torch.randn(t.shape, generator=g) * 1e-3
        opts[key] = opt
    times: dict[str, list[float]] = {k: [] for k in opts}
    for i in range(warmup + steps):
        for key, opt in opts.items():  # interleaved: drift and other load hit every variant alike
            dist.barrier()
            t0 = time.perf_counter()
            opt.step(1e-3)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # a step lasts until the slowest rank is done
            if i >= warmup:
                times[key].append(float(dt))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    k: {"median_s": statistics.median(v), "all_s": v, "comm_bytes_rank0": opts[k].comm_bytes()}
                    for k, v in times.items()
                },
                f,
            )


def schemes(model: str, layouts: list[str], steps: int, warmup: int, root: str) -> list[dict]:
    from moeckpt.trainer.local_world import run_local_world

    rows = []
    for text in layouts:
        layout = _layout(text)
        out = os.path.join(root, f"schemes-{text.replace(',', '-')}.json")
        threads = max(1, (os.cpu_count() or 1) // layout.world)
        run_local_world(_scheme_worker, layout.world, model, text, steps, warmup, threads, out, timeout_s=1800)
        with open(out) as f:
            got = json.load(f)
        row = {
            "layout": layout.to_json(),
            "threads_per_rank": threads,
            **got,
            "gather_over_assign": got["gather"]["median_s"] / got["assign"]["median_s"],
        }
        rows.append(row)
        print(
            f"schemes {text}: assign {got['assign']['median_s'] * 1e3:.1f} ms, gather "
            f"{got['gather']['median_s'] * 1e3:.1f} ms, adamw {got['adamw']['median_s'] * 1e3:.1f} ms",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------------------------- checkpoint


def _train_worker(rank: int, config: dict, threads: int) -> None:
    from moeckpt.trainer.train import TrainConfig, train

    torch.set_num_threads(threads)
    train(TrainConfig.from_json(config))


def checkpoint(model: str, layout_text: str, reps: int, root: str) -> dict:
    from moeckpt.formats.checkpoint import CheckpointReader
    from moeckpt.trainer.local_world import run_local_world
    from moeckpt.trainer.metrics import read_metrics
    from moeckpt.trainer.train import TrainConfig

    layout = _layout(layout_text)
    threads = max(1, (os.cpu_count() or 1) // layout.world)
    out = {"layout": layout.to_json()}
    for optimizer in ("adamw", "muon"):
        best: dict | None = None
        for rep in range(reps):
            run = os.path.join(root, f"ckpt-{optimizer}-{rep}")
            base = {
                "model": model,
                "run_dir": run,
                "tp": layout.tp,
                "ep": layout.ep,
                "steps": 2,
                "save_every": 2,
                "seq_len": 64,
                "global_batch": 2 * layout.dp,
                "warmup_steps": 1,
                "cpu": True,
                "async_save": False,
                "optimizer": optimizer,
                "resume_reads": "own",
            }
            run_local_world(_train_worker, layout.world, TrainConfig(**base).to_json(), threads, timeout_s=1800)
            saved = [r for r in read_metrics(run) if r["step"] == 2][-1]["save_blocked_s"]
            # the same command again: it resumes step 2 (and has nothing left to train)
            run_local_world(_train_worker, layout.world, TrainConfig(**base).to_json(), threads, timeout_s=1800)
            (event,) = [r for r in read_metrics(run, events=True) if r.get("event") == "resume"]
            index = CheckpointReader(run).index
            row = {
                "save_s": saved,
                "resume_s": event["seconds"],
                "bytes_read": event["bytes_read"],
                "checkpoint_bytes": sum(f.size for f in index.files.values()),
                "roles": sorted({e.role for e in index.tensors.values()}),
            }
            if best is None or row["save_s"] + row["resume_s"] < best["save_s"] + best["resume_s"]:
                best = row
            shutil.rmtree(run, ignore_errors=True)
        out[optimizer] = best
    out["muon_over_adamw"] = {k: out["muon"][k] / out["adamw"][k] for k in ("save_s", "resume_s", "checkpoint_bytes")}
    print(
        f"checkpoint {layout_text}: muon/adamw save {out['muon_over_adamw']['save_s']:.2f}x, resume "
        f"{out['muon_over_adamw']['resume_s']:.2f}x, bytes {out['muon_over_adamw']['checkpoint_bytes']:.2f}x",
        flush=True,
    )
    return out


# ------------------------------------------------------------------------------------------------ drill


def drill(steps: int, kill_at: int, root: str, out_dir: str) -> dict:
    from moeckpt.trainer.elastic_drill import (
        cpu_drill_args,
        plot_drill,
        run_shrink_grow_drill,
    )

    run = os.path.join(root, "drill")
    result = run_shrink_grow_drill(
        run,
        cpu_drill_args(run, steps=steps) + ["--optimizer", "muon"],
        nproc=2,
        kill_at_step=kill_at,
        timeout_s=900,
        progress=lambda s: print(s, flush=True),
    )
    worlds = result.worlds()
    resumes = [e for e in result.events() if e["event"] == "resume"]
    steps_done = result.steps()
    # (node A may train a step alone before B joins: the shrink and the grow are the 4 -> 2 -> 4 in the sequence)
    sequence = ",".join(str(w) for _, w in worlds)
    ok = (
        result.exit_codes == {"A": 0, "C": 0} and "4,2,4" in sequence and steps_done and steps_done[-1]["step"] == steps
    )
    plot_drill(
        result,
        os.path.join(out_dir, "muon_drill.png"),
        title="Muon under torchrun elastic agents: a node lost, then a node joining",
    )
    if not ok:
        raise SystemExit(f"the drill did not shrink and grow: exit codes {result.exit_codes}, worlds {worlds}")
    print(
        f"drill: worlds {[w for _, w in worlds]}, resumes {[(r['from_layout']['dp'], r['to_layout']['dp']) for r in resumes]}",
        flush=True,
    )
    return {
        "worlds": worlds,
        "timeline": result.timeline,
        "exit_codes": result.exit_codes,
        "resumes": [{"step": r["step"], "from": r["from_layout"], "to": r["to_layout"]} for r in resumes],
        "losses": [[r["step"], r["world"], r["loss"]] for r in steps_done],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--parts",
        nargs="+",
        default=["comm", "schemes", "checkpoint", "drill"],
        choices=["comm", "schemes", "checkpoint", "drill"],
    )
    p.add_argument("--comm-model", default="zaya-small")
    p.add_argument("--comm-layouts", nargs="+", default=["1,1,8", "1,8,8", "1,2,8", "2,4,8", "1,4,16", "2,2,4"])
    p.add_argument("--scheme-model", default="scaled", help="a preset, a config.json, or 'scaled' (a small zaya)")
    p.add_argument("--scheme-layouts", nargs="+", default=["1,1,4", "1,2,4", "2,2,2"])
    p.add_argument("--scheme-steps", type=int, default=10)
    p.add_argument("--scheme-warmup", type=int, default=2)
    p.add_argument("--ckpt-model", default="scaled")
    p.add_argument("--ckpt-layout", default="1,2,2")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--drill-steps", type=int, default=80)
    p.add_argument("--drill-kill-at", type=int, default=17)
    p.add_argument("--tiny", action="store_true", help="tiny sizes: prove the script runs, measure nothing")
    p.add_argument("--out", default=OUT_DIR)
    args = p.parse_args()
    if args.tiny:
        args.comm_model, args.comm_layouts = "zaya-tiny", ["1,1,2", "2,2,2"]
        args.scheme_model, args.scheme_layouts, args.scheme_steps, args.scheme_warmup = "zaya-tiny", ["1,1,2"], 2, 1
        args.ckpt_model, args.ckpt_layout, args.reps = "zaya-tiny", "1,1,1", 1
        # the drill keeps its length: node C must join before the survivors finish
    os.makedirs(args.out, exist_ok=True)
    root = tempfile.mkdtemp(prefix="bench-muon-")
    results: dict = {
        "tiny": args.tiny,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/bench_muon.py " + " ".join(a for a in os.sys.argv[1:]),
    }
    try:
        if "comm" in args.parts:
            results["comm"] = {
                "model": args.comm_model,
                "param_dtype": "bfloat16",
                "layouts": comm(args.comm_model, args.comm_layouts),
            }
        model = _model(args.scheme_model, root)
        if "schemes" in args.parts:
            results["schemes"] = {
                "model": args.scheme_model,
                "layouts": schemes(model, args.scheme_layouts, args.scheme_steps, args.scheme_warmup, root),
            }
        if "checkpoint" in args.parts:
            results["checkpoint"] = {
                "model": args.ckpt_model,
                **checkpoint(_model(args.ckpt_model, root), args.ckpt_layout, args.reps, root),
            }
        if "drill" in args.parts:
            results["drill"] = drill(args.drill_steps, args.drill_kill_at, root, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = os.path.join(args.out, "muon_cpu.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
