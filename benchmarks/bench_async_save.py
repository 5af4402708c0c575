"""Async save stall and persist throughput (issue 8): moeckpt vs a pinned device-to-host copy, raw write+fsync and
torch DCP (``async_save`` with default and pinned staging, and synchronous ``save``), on the same state, one run.

The state is a scaled ZAYA model in bf16 plus fp32 master weights and AdamW moments (14 bytes per parameter), on
the GPU when there is one. Every figure is wall time of the calling (training) thread:

* ``copy``: device -> pinned host copy of exactly the bytes saved (the floor any async save can reach);
* ``moeckpt blocked``: ``CheckpointManager.save`` returning (snapshot into reused pinned buffers);
* ``moeckpt persist``: the background write until committed (``wait()``), against ``raw``: one write+fsync of the
  same bytes from pinned host memory;
* DCP: ``async_save`` until it returns (blocked) and until its future completes; ``save`` (synchronous).

Usage: ``python benchmarks/bench_async_save.py --gb 16 --dir /tmp/bench --out docs/benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import time

import torch
import torch.distributed as dist


def _scaled_zaya(gb: float):
    from moeckpt.trainer.models.zaya.config import ZayaConfig
    from moeckpt.trainer.models.zaya.plan import param_specs

    base = {
        "vocab_size": 32768,
        "hidden_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "moe_intermediate_size": 2048,
        "num_experts": 16,
        "router_hidden_size": 256,
    }
    one, two = (sum(_numel(p.shape) for p in param_specs(ZayaConfig(num_hidden_layers=n, **base))) for n in (1, 2))
    per_layer, rest = two - one, 2 * one - two
    layers = max(1, -(-round(gb * 1e9 / 14 - rest) // per_layer))  # at least gb
    cfg = ZayaConfig(num_hidden_layers=layers, **base)
    return cfg, param_specs(cfg)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as e:  # not permitted in some VMs: the figures then include a warm page cache
        print(f"(could not drop page cache: {e})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=16.0, help="state size in GB (bf16 params + fp32 master/moments)")
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-async", help="scratch directory on the disk under test")
    ap.add_argument("--out", default="docs/benchmarks", help="where results go")
    ap.add_argument("--skip-dcp", action="store_true")
    args = ap.parse_args()

    from moeckpt.reshard.layout import Layout
    from moeckpt.reshard.tensors import logical_tensors
    from moeckpt.trainer.checkpointing import CheckpointManager

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    cfg, specs = _scaled_zaya(args.gb)
    tensors = logical_tensors(specs, param_dtype="bfloat16", with_optimizer=True)
    state = {}
    for name, e in tensors.items():
        dtype = torch.bfloat16 if e.dtype == "bfloat16" else torch.float32
        state[name] = torch.randn(e.shape, device=device, dtype=torch.float32).to(dtype)
    _sync(device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {nbytes / 1e9:.2f} GB on {device} ({cfg.num_hidden_layers} ZAYA layers)")
    results: dict[str, object] = {
        "bytes": nbytes,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "layers": cfg.num_hidden_layers,
    }
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)

    # 1. the floor: device -> pinned host copy into preallocated buffers
    pin = device.type == "cuda"
    host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in state.items()}
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        for n, t in state.items():
            host[n].copy_(t, non_blocking=True)
        _sync(device)
        copies.append(time.perf_counter() - t0)
    results["copy_s"] = min(copies)
    print(f"pinned D2H copy: {results['copy_s']:.3f}s")

    # 2. raw write+fsync of the same bytes from pinned memory
    _drop_caches()
    raw = os.path.join(args.dir, "raw.bin")
    t0 = time.perf_counter()
    with open(raw, "wb") as f:
        for t in host.values():
            f.write(memoryview(t.view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())
    results["raw_write_fsync_s"] = time.perf_counter() - t0
    os.remove(raw)
    del host
    print(f"raw write+fsync: {results['raw_write_fsync_s']:.2f}s")

    # 3. moeckpt async saves (the first allocates the pinned buffers, later ones reuse them)
    run_dir = os.path.join(args.dir, "moeckpt")
    mgr = CheckpointManager(run_dir, tensors=tensors, layout=Layout(), model={"arch": "zaya", "config": cfg.to_json()})
    blocked, persist = [], []
    for step in (1, 2, 3):
        _drop_caches()
        t0 = time.perf_counter()
        stats = mgr.save(step, state, {"step": step})
        blocked.append(stats.blocked_s)
        mgr.wait()
        persist.append(time.perf_counter() - t0 - stats.blocked_s)
        print(f"moeckpt save {step}: blocked {stats.blocked_s:.3f}s, persist {persist[-1]:.2f}s")
    mgr.close()
    results["moeckpt_blocked_s"] = blocked
    results["moeckpt_persist_s"] = persist
    shutil.rmtree(run_dir)

    # 4. DCP
    if not args.skip_dcp:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        def dcp_async(tag: str, stager_factory) -> None:
            out = []
            for i in range(2):
                path = os.path.join(args.dir, f"dcp-{tag}-{i}")
                _drop_caches()
                try:
                    kw = {"async_stager": stager_factory()} if stager_factory else {}
                    t0 = time.perf_counter()
                    resp = dcp.async_save(state, checkpoint_id=path, **kw)
                    t_blocked = time.perf_counter() - t0
                    fut = getattr(resp, "upload_completion", resp)
                    staging = getattr(resp, "staging_completion", None)
                    if staging is not None:
                        staging.result()
                        t_blocked = max(t_blocked, time.perf_counter() - t0) if not kw else t_blocked
                    fut.result()
                    out.append({"blocked_s": t_blocked, "total_s": time.perf_counter() - t0})
                except Exception as e:  # noqa: BLE001 - a peer's crash is a result to report
                    out.append({"error": f"{type(e).__name__}: {e}"[:300]})
                print(f"dcp async {tag} save {i + 1}: {out[-1]}")
                shutil.rmtree(path, ignore_errors=True)
            results[f"dcp_async_{tag}"] = out

        dcp_async("default", None)
        dcp_async(
            "pinned",
            lambda: DefaultStager(
                StagingOptions(
                    use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
                )
            ),
        )
        path = os.path.join(args.dir, "dcp-sync")
        _drop_caches()
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=path)
        _fsync_tree(path)
        results["dcp_sync_s"] = time.perf_counter() - t0
        print(f"dcp sync save (+fsync): {results['dcp_sync_s']:.2f}s")
        shutil.rmtree(path, ignore_errors=True)

    steady_blocked = min(blocked[1:])
    results["ratios"] = {
        "moeckpt_blocked_over_copy": steady_blocked / results["copy_s"],
        "moeckpt_persist_vs_raw_throughput": results["raw_write_fsync_s"] / min(persist),
    }
    if "dcp_sync_s" in results:
        results["ratios"]["moeckpt_persist_speedup_vs_dcp_sync"] = results["dcp_sync_s"] / min(persist)
    print(json.dumps(results["ratios"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "async_save.json"), "w") as f:
        json.dump(results, f, indent=1)
    _plot(results, os.path.join(args.out, "async_save.png"))
    dist.destroy_process_group()


def _plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colors = ["D2H pinned copy"], [r["copy_s"]], ["#888888"]
    labels += ["moeckpt (1st save)", "moeckpt (steady)"]
    values += [r["moeckpt_blocked_s"][0], min(r["moeckpt_blocked_s"][1:])]
    colors += ["#1f77b4", "#1f77b4"]
    for tag in ("default", "pinned"):
        for i, run in enumerate(r.get(f"dcp_async_{tag}", [])):
            if "blocked_s" in run:
                labels.append(f"DCP async {tag} #{i + 1}")
                values.append(run["blocked_s"])
                colors.append("#d62728")
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(labels, values, color=colors)
    a.set_xlabel("seconds training is blocked")
    a.set_title(f"Async save stall, {r['bytes'] / 1e9:.1f} GB state")
    p_labels = ["raw write+fsync", "moeckpt persist"]
    p_values = [r["raw_write_fsync_s"], min(r["moeckpt_persist_s"])]
    if "dcp_sync_s" in r:
        p_labels.append("DCP save (sync)")
        p_values.append(r["dcp_sync_s"])
    b.barh(p_labels, [r["bytes"] / 1e9 / v for v in p_values], color=["#888888", "#1f77b4", "#d62728"][: len(p_values)])
    b.set_xlabel("GB/s to local disk")
    b.set_title("Persist throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
