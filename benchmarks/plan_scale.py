"""Planning at scale: a ZAYA1-8B checkpoint saved on 1,024 ranks, planned for another 1,024-rank layout.

No data and no processes: the index is built from the model's plan (one file entry per writer, as a real save
writes), then the pure planner runs for one loading rank, 16 loading ranks, every loading rank, and every offline
writer. Writes ``plan_scale.json`` under ``--out``.

    python benchmarks/plan_scale.py --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

from moeckpt.formats.index import FileEntry, Index
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.planner import plan_load, plan_reshard
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.models import presets


def build_index(preset: str, layout: Layout) -> Index:
    """The index a save of ``preset`` (bf16 parameters, fp32 master and AdamW moments) in ``layout`` writes."""
    spec = presets()[preset]
    tensors = logical_tensors(spec.param_specs(), param_dtype="bfloat16", with_optimizer=True)
    files = {
        f"rank-{r:05d}.safetensors": FileEntry(path=f"rank-{r:05d}.safetensors", size=8, checksum="xxh3_64:" + "0" * 16)
        for r in range(layout.world)
    }
    return Index(backend="safetensors", step=1, layout=layout.to_json(), model=spec.to_json(), tensors=tensors,
                 files=files)


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--preset", default="zaya1-8b")
    args = parser.parse_args()
    source, target = Layout(tp=1, ep=16, dp=1024), Layout(tp=2, ep=8, dp=512)
    index, build_s = timed(lambda: build_index(args.preset, source))
    raw = index.dumps()
    result = {
        "preset": args.preset, "source": source.to_json(), "target": target.to_json(),
        "logical_tensors": len(index.tensors), "state_bytes": index.nbytes, "index_bytes": len(raw),
        "index_build_s": round(build_s, 3),
        "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    one, s = timed(lambda: plan_load(index, target, [777]))
    result["load_plan_one_rank_s"] = round(s, 3)
    result["load_one_rank_pieces"] = len(one.ranks[0].pieces)
    result["load_one_rank_bytes"] = one.ranks[0].nbytes
    _, s = timed(lambda: plan_load(index, target, range(0, target.world, 64)))
    result["load_plan_16_ranks_s"] = round(s, 3)
    every, s = timed(lambda: plan_load(index, target, range(target.world)))
    result["load_plan_all_ranks_s"] = round(s, 1)
    result["load_all_ranks_pieces"] = sum(len(r.pieces) for r in every.ranks)
    del every
    offline, s = timed(lambda: plan_reshard(index, target))
    result["offline_plan_all_writers_s"] = round(s, 1)
    result["offline_target_pieces"] = sum(len(r.pieces) for r in offline.ranks)
    del offline
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan_scale.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
