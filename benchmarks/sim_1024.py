"""A 1,024-rank save and resume of ZAYA1-8B through the real planner, writers and readers, on one core.

The state (bf16 parameters, fp32 masters, AdamW moments: 123.8 GB) is zeros, saved in tp=1 ep=16 dp=1024 to a
``count://`` storage (:mod:`moeckpt.testing.counting`) that keeps only the non-zero bytes written (the files'
headers and the index) and counts bytes, objects and requests per rank and per directory. One process loops over
the ranks: every source writer writes its file through the safetensors backend (``--writers`` samples fewer, then
no resume is possible), then a sample of the target ranks of tp=2 ep=8 dp=512 resume alone
(``load_rank_state``: plan, headers, reads, checksums of what they read), since all 1,024 would read 1.9 TB of
zeros here; the per-rank figures of the sample are reported as they are and the totals extrapolated (ranks of
one layout hold the same share, so the sample's mean times 1,024). DCP's central planning step on the same
pieces is timed beside it (see ``dcp_global_plan``). Writes ``sim_1024.json`` and ``sim_1024.png``.

    python benchmarks/sim_1024.py --out docs/benchmarks --load-ranks 8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import begin_save, commit
from moeckpt.formats.index import INDEX_NAME, Index
from moeckpt.formats.pieces import Piece
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.placement import placements
from moeckpt.reshard.planner import plan_load
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.testing import counting
from moeckpt.trainer.models import presets


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def dcp_global_plan(tensors, worlds: list[int], limit_s: float) -> list[dict]:
    """DCP's central save planning on rank 0 (``DefaultSavePlanner.create_global_plan``: dedup of replicated
    items, metadata, ``_validate_global_plan``) over the local plans the ranks of tp=1 ep=16 dp=``world`` would
    send it: one ``WriteItem`` per piece a rank holds (as DTensors shard it), for growing worlds until one takes
    over ``limit_s``. Built directly rather than through torch's fake process group: the group would only carry
    the plans to rank 0, and the global step is where the cost in ranks lies (torch #163548)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    from moeckpt.reshard.placement import rank_boxes

    out = []
    for world in worlds:
        layout = Layout(tp=1, ep=16, dp=world)
        started = time.perf_counter()
        plans = []
        props = {n: TensorProperties(dtype=dtypes.to_torch(e.dtype)) for n, e in tensors.items()}
        for rank in range(world):
            items = []
            for entry in tensors.values():
                for box in rank_boxes(entry, layout, rank):  # every rank proposes what it holds; DCP dedups
                    offsets = torch.Size(box.offsets)
                    items.append(
                        WriteItem(
                            index=MetadataIndex(entry.name, offsets),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(box.shape)),
                                properties=props[entry.name],
                                size=torch.Size(entry.shape),
                            ),
                        )
                    )
            plans.append(SavePlan(items, planner_data={}))
        built_s = time.perf_counter() - started
        started, cpu = time.perf_counter(), time.process_time()
        DefaultSavePlanner().create_global_plan(plans)
        row = {
            "world": world,
            "write_items": sum(len(p.items) for p in plans),
            "local_plans_built_s": round(built_s, 2),
            "global_plan_s": round(time.perf_counter() - started, 2),
            "global_plan_cpu_s": round(time.process_time() - cpu, 2),
        }
        print(row, flush=True)
        out.append(row)
        del plans
        if row["global_plan_s"] > limit_s:
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--preset", default="zaya1-8b")
    parser.add_argument("--writers", type=int, default=0, help="source writers to save (0: all; fewer: no resume)")
    parser.add_argument("--load-ranks", type=int, default=8, help="target ranks that resume (evenly spread)")
    parser.add_argument("--no-dcp", action="store_true", help="skip DCP's global plan")
    parser.add_argument("--dcp-worlds", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--dcp-limit-s", type=float, default=60.0, help="stop DCP's sizes after one this slow")
    args = parser.parse_args()
    source, target = Layout(tp=1, ep=16, dp=1024), Layout(tp=2, ep=8, dp=512)
    spec = presets()[args.preset]
    tensors = logical_tensors(spec.param_specs(), param_dtype="bfloat16", with_optimizer=True)
    name = f"sim-{os.getpid()}"
    location = f"count://{name}/run/step-00000001"
    tally = counting.tally(name)
    result: dict = {
        "preset": args.preset,
        "source": source.to_json(),
        "target": target.to_json(),
        "logical_tensors": len(tensors),
        "machine": f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}, torch {torch.__version__}",
        "command": "python " + " ".join(sys.argv),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    gc.disable()  # millions of small objects: see reshard/planner.py's _paused_gc

    # -- save: every writer's pieces (the real placements), each writer's file through the real backend -----
    started = time.perf_counter()
    by_writer: dict[int, list[tuple[str, Box]]] = {w: [] for w in range(source.world)}
    boxes: dict[str, list[Box]] = {}
    for entry in tensors.values():
        for p in placements(entry, source):
            by_writer[p.writer].append((entry.name, p.box))
            boxes.setdefault(entry.name, []).append(p.box)
    result["save_placements_all_writers_s"] = round(time.perf_counter() - started, 2)
    result["stored_pieces"] = sum(len(v) for v in by_writer.values())
    backend = get_backend("safetensors")
    storage = begin_save(location)
    backend.prepare(storage, tensors, boxes)
    writers = (
        list(range(source.world)) if not args.writers else list(range(0, source.world, source.world // args.writers))
    )
    entries, write_s = [], []
    for w in writers:
        with tally.as_rank(w):
            started = time.perf_counter()
            pieces = [
                Piece(n, b, torch.zeros(b.shape, dtype=dtypes.to_torch(tensors[n].dtype))) for n, b in by_writer[w]
            ]
            entries += backend.write(storage, w, pieces, tensors)
            del pieces
            write_s.append(time.perf_counter() - started)
        if w % 128 == 0:
            print(f"writer {w}: {write_s[-1]:.2f} s", flush=True)
    index = Index(
        backend="safetensors",
        step=1,
        layout=source.to_json(),
        model=spec.to_json(),
        tensors=tensors,
        files={e.path: e for e in backend.finish(storage, entries, tensors)},
    )
    with tally.as_rank(0):
        commit(location, index)
    save_counts = {r: c.to_json() for r, c in tally.per_rank.items() if r >= 0 or c.write_requests}
    per_writer = [save_counts[w] for w in writers]
    result["save"] = {
        "writers_saved": len(writers),
        "seconds_per_writer": spread([round(s, 3) for s in write_s]),
        "bytes_per_writer": spread([c["write_bytes"] for c in per_writer]),
        "write_requests_per_writer": spread([c["write_requests"] for c in per_writer]),
        "objects_per_directory": {d: c.objects for d, c in tally.per_dir.items()},
        "index_bytes": tally.objects[f"run/step-00000001/{INDEX_NAME}"].size,
        "bytes_kept_by_the_storage": sum(len(d) for o in tally.objects.values() for _, d in o.segments),
        "state_bytes": index.nbytes,
    }
    print(json.dumps(result["save"]), flush=True)

    # -- resume: a sample of target ranks, each alone, through the real planner and readers ------------------
    if len(writers) == source.world:
        tally.reset_counts()
        step = max(1, target.world // args.load_ranks)
        sample = list(range(step // 2, target.world, step))[: args.load_ranks]
        rows = []
        for r in sample:
            started = time.perf_counter()
            plan_load(index, target, [r])
            plan_s = time.perf_counter() - started
            stats = LoadStats()
            with tally.as_rank(r):
                started = time.perf_counter()
                load_rank_state(location, target, r, stats=stats)
                load_s = time.perf_counter() - started
            c = tally.per_rank[r]
            rows.append(
                {
                    "rank": r,
                    "plan_s": round(plan_s, 3),
                    "load_s": round(load_s, 2),
                    "bytes_needed": stats.bytes_needed,
                    "bytes_read": c.read_bytes,
                    "read_requests": c.read_requests,
                }
            )
            print(rows[-1], flush=True)
        mean_read = statistics.mean(x["bytes_read"] for x in rows)
        result["resume"] = {
            "ranks": rows,
            "sampled": len(rows),
            "plan_s_per_rank": spread([x["plan_s"] for x in rows]),
            "bytes_read_per_rank": spread([x["bytes_read"] for x in rows]),
            "read_requests_per_rank": spread([x["read_requests"] for x in rows]),
            "read_over_needed": round(sum(x["bytes_read"] for x in rows) / sum(x["bytes_needed"] for x in rows), 4),
            "extrapolated_bytes_read_all_ranks": int(mean_read * target.world),
            "extrapolated_read_requests_all_ranks": int(
                statistics.mean(x["read_requests"] for x in rows) * target.world
            ),
        }
    if not args.no_dcp:
        result["dcp_global_plan"] = dcp_global_plan(tensors, args.dcp_worlds, args.dcp_limit_s)
        print(result["dcp_global_plan"], flush=True)
    counting.forget(name)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sim_1024.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "sim_1024.png"))
    print(json.dumps(result, indent=1))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    save = result["save"]
    ax = axes[0]
    ax.set_title("save, per source writer (every writer)")
    b = save["bytes_per_writer"]
    ax.bar(["min", "median", "max"], [b["min"] / 1e6, b["median"] / 1e6, b["max"] / 1e6], color="tab:blue")
    ax.set_ylabel("MB written")
    ax = axes[1]
    if "resume" in result:
        rows = result["resume"]["ranks"]
        ax.set_title("resume, sampled target ranks (each alone)")
        ax.bar([str(x["rank"]) for x in rows], [x["bytes_read"] / 1e9 for x in rows], color="tab:blue", label="read")
        ax.scatter(
            [str(x["rank"]) for x in rows],
            [x["bytes_needed"] / 1e9 for x in rows],
            color="black",
            s=12,
            zorder=3,
            label="needed",
        )
        ax.set_xlabel("target rank")
        ax.set_ylabel("GB")
        ax.legend()
    fig.suptitle("zaya1-8b, tp1 ep16 dp1024 -> tp2 ep8 dp512, through a count:// storage")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
