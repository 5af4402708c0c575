"""Compression benchmark (issue 32, item 4 and its targets): what ``--compress blosc-zstd`` saves on a trained
checkpoint, how far that is from the order-0 entropy of its bytes, and what it costs in save and load time, side by
side with the same checkpoint uncompressed, in one run.

Phases, numbered by topic and run in the order train, entropy, sizes, tensorstore, timing, codecs (each writes its
results into the JSON as soon as it is done, and the timing after every repetition, so a run cut short keeps what
it measured):

1. **train**: ``moeckpt train`` (the bundled trainer; on the GPU when one is visible), AdamW, bf16 parameters with
   fp32 master weights, saved once at the end in zarr, uncompressed. A run past ``--train-timeout`` gets SIGTERM,
   which makes the trainer save at its next step and exit; the JSON says which step was reached.
2. **entropy**: the trained state read back; per role and dtype (the index's ``TensorEntry.role``), the Shannon
   entropy of each byte position of the element (little-endian: position 0 is the least significant byte), and
   their sum as bits/element: what an order-0 coder with one model per byte position could reach at best, pooled
   over the role (one model per role) and per tensor (one model per tensor, weighted by elements).
3. **codecs**: every tensor cut into the inner chunks' size and encoded with numcodecs' blosc in one thread per
   core, with moeckpt's settings and with other settings of zarr v3's standard ``blosc`` codec; the bytes per role
   and the wall time to encode and decode them all (reported only; the codec defaults are not changed here).
4. **sizes**: ``moeckpt reshard CKPT CKPT-z --compress blosc-zstd`` (timed once), the stored bytes of every array
   on disk against the uncompressed checkpoint's, per role and in all; ``moeckpt diff CKPT CKPT-z`` (exit 0: the
   same values); with ``--reshard-back``, ``moeckpt reshard CKPT-z CKPT-back --compress none`` (timed once).
5. **timing**: ``moeckpt.save`` of the trained state (in memory, CPU tensors) to local disk and ``moeckpt.load``
   of it into preallocated tensors, uncompressed and blosc-zstd alternating (the first setting alternates between
   repetitions), ``--reps`` times each. Before every save the destination is deleted, dirty pages written back
   and the page cache dropped; each load runs twice: cold (page cache dropped just before) and warm (right after
   the cold one, its files in the page cache). Wall time and the process's CPU time of each.
6. **tensorstore**: tensorstore's ``zarr3`` driver reads every compressed array of CKPT-z (``--tensorstore-largest``:
   only the largest of each dtype), each compared byte for byte with the trained state.

The S3 figures are a model, not a measurement: stored bytes over a stated network bandwidth, plus (serial) or
overlapped with (``max``) the measured CPU time of the local save or cold load spread over the machine's cores.

    python benchmarks/bench_compress.py --out docs/benchmarks         # the full run (a GPU host)
    python benchmarks/bench_compress.py --cpu --model zaya-tiny --steps 20 --global-batch 8 --seq-len 64 \\
        --reps 2 --work /tmp/bench_compress --out /tmp/bench_compress/out     # a quick check on a CPU
    python benchmarks/bench_compress.py --report docs/benchmarks/compress.json  # tables of a run, and the plot
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numcodecs import blosc

import moeckpt
from moeckpt.formats.backends.zarr import INNER_CHUNK_BYTES
from moeckpt.formats.backends.zarr_array import BLOSC_BLOCKSIZE, BLOSC_CLEVEL, BLOSC_CNAME
from moeckpt.formats.checkpoint import CheckpointReader, committed_steps

NONE, BLOSC = "none", "blosc-zstd"
ROLE_ORDER = ("param", "master", "exp_avg", "exp_avg_sq", "momentum", "buffer")
#: blosc settings compared (name: cname, clevel, shuffle, blocksize, what it is); the first is moeckpt's own.
SETTINGS: dict[str, tuple[str, int, int, int, str]] = {
    "moeckpt": (
        BLOSC_CNAME,
        BLOSC_CLEVEL,
        blosc.SHUFFLE,
        BLOSC_BLOCKSIZE,
        f"blosc {BLOSC_CNAME} level {BLOSC_CLEVEL}, byte shuffle, {BLOSC_BLOCKSIZE >> 20} MiB blocks (as written)",
    ),
    "zstd3": ("zstd", 3, blosc.SHUFFLE, 1 << 20, "blosc zstd level 3, byte shuffle, 1 MiB blocks"),
    "bitshuffle": ("zstd", 1, blosc.BITSHUFFLE, 1 << 20, "blosc zstd level 1, bit shuffle, 1 MiB blocks"),
    "lz4": ("lz4", 5, blosc.SHUFFLE, 1 << 20, "blosc lz4 level 5, byte shuffle, 1 MiB blocks"),
}
TARGETS = {"param_ratio": 1.3, "state_ratio": 1.15, "time_ratio": 1.1}
S3_GBIT = (10.0, 25.0)  # the network bandwidths of the S3 model, Gbit/s


# -- small tools ---------------------------------------------------------------------------------------------------
def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def sh(cmd: str) -> str:
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=False).stdout.strip()


def cli(*args: str) -> list[str]:
    """The moeckpt command line, run by this interpreter (no console script needed)."""
    return [sys.executable, "-m", "moeckpt.cli.main", *args]


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def drop_caches() -> str:
    """Write back dirty pages, then drop the page cache; says whether the drop happened."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as e:  # not root, or not permitted in this VM: the loads then start warm
        return f"not dropped ({e.strerror})"


def dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def array_bytes(root: str, names: set[str]) -> dict[str, int]:
    """Bytes on disk of each array's objects (its chunks or shards and its ``zarr.json``); the rest (group documents,
    the index) under ``""``."""
    out: dict[str, int] = defaultdict(int)
    for d, _, files in os.walk(root):
        rel = os.path.relpath(d, root).replace(os.sep, "/")
        for f in files:
            path = f if rel == "." else f"{rel}/{f}"
            key = path.split("/c/")[0] if "/c/" in path else path.rsplit("/", 1)[0] if "/" in path else ""
            out[key if key in names else ""] += os.path.getsize(os.path.join(d, f))
    return dict(out)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's little-endian bytes as a flat uint8 array (a view when contiguous; bf16 included)."""
    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def group_key(role: str, dtype: str) -> str:
    return f"{role} {dtype}"


def group_order(keys) -> list[str]:
    def rank(k: str) -> tuple[int, str]:
        role = k.split(" ")[0]
        return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), k)

    return sorted(keys, key=rank)


class Results:
    """The JSON of the run, rewritten after every phase."""

    def __init__(self, path: str, data: dict) -> None:
        self.path, self.data = path, data

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


# -- 1. train ------------------------------------------------------------------------------------------------------
def train(args, run_dir: str) -> dict:
    options = (
        f"--model {args.model} --dtype bf16 --steps {args.steps} --global-batch {args.global_batch} "
        f"--seq-len {args.seq_len} --format zarr --compress {NONE} --save-every 0 --sync-save "
        f"--log-every {max(1, args.steps // 10)}" + (" --cpu" if args.cpu else "")
    )
    cmd = cli("train", "--run-dir", run_dir, *options.split())
    log_path = os.path.join(args.work, "train.log")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        stopped = False
        try:
            rc = proc.wait(timeout=args.train_timeout)
        except subprocess.TimeoutExpired:
            stopped = True  # SIGTERM: the trainer saves at its next step and exits 0
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=300)
    wall = time.perf_counter() - t0
    with open(log_path) as f:
        tail = f.read().splitlines()[-8:]
    print("\n".join(tail), flush=True)
    if rc != 0:
        raise SystemExit(f"train failed (exit {rc}): {' '.join(tail)}")
    steps = committed_steps(run_dir)
    if not steps:
        raise SystemExit(f"train left no committed checkpoint in {run_dir}")
    step, storage = steps[-1]
    losses = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:
                losses.append((rec["step"], rec["loss"]))
    return {
        "command": shlex.join(["moeckpt", *cmd[3:]]),
        "wall_s": wall,
        "stopped_by_sigterm": stopped,
        "step": step,
        "checkpoint": storage.location,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }


# -- 2. entropy ----------------------------------------------------------------------------------------------------
def histograms(t: torch.Tensor, device: str) -> np.ndarray:
    """(element size, 256) counts of each byte value at each byte position of the elements."""
    k = t.element_size()
    planes = torch.from_numpy(raw_bytes(t)).reshape(-1, k)
    if device == "cuda":
        try:
            on = planes.to("cuda")
            return np.stack([torch.bincount(on[:, j].contiguous(), minlength=256).cpu().numpy() for j in range(k)])
        except RuntimeError as e:  # a torch without bincount of bytes on the GPU: count on the CPU instead
            print(f"  (bincount on the GPU failed, counting on the CPU: {e})")
    arr = planes.numpy()
    return np.stack([np.bincount(arr[:, j], minlength=256) for j in range(k)])


def entropy_bits(hist: np.ndarray) -> list[float]:
    """Shannon entropy (bits) of each row of counts."""
    out = []
    for row in hist:
        n = row.sum()
        p = row[row > 0] / n if n else np.zeros(0)
        out.append(float(-(p * np.log2(p)).sum()) if n else 0.0)
    return out


def entropy_phase(state: dict[str, torch.Tensor], groups: dict[str, list[str]], device: str) -> dict:
    t0 = time.perf_counter()
    out = {}
    for key, names in groups.items():
        pooled = None
        weighted = 0.0
        elements = 0
        for name in names:
            t = state[name]
            if t.numel() == 0:
                continue
            h = histograms(t, device)
            pooled = h if pooled is None else pooled + h
            weighted += t.numel() * sum(entropy_bits(h))
            elements += t.numel()
        if pooled is None:
            continue
        per_pos = entropy_bits(pooled)
        bits = 8 * pooled.shape[0]
        out[key] = {
            "tensors": len(names),
            "elements": elements,
            "bits_per_element_raw": bits,
            "entropy_per_byte_position_bits": per_pos,
            "bound_bits_per_element_pooled": sum(per_pos),
            "bound_ratio_pooled": bits / sum(per_pos) if sum(per_pos) else math.inf,
            "bound_bits_per_element_per_tensor": weighted / elements,
            "bound_ratio_per_tensor": bits * elements / weighted if weighted else math.inf,
        }
    return {"groups": out, "wall_s": time.perf_counter() - t0, "device": device}


# -- 3. codecs -----------------------------------------------------------------------------------------------------
def chunks_of(t: torch.Tensor) -> list[np.ndarray]:
    b = raw_bytes(t)
    return [b[i : i + INNER_CHUNK_BYTES] for i in range(0, len(b), INNER_CHUNK_BYTES)]


def codec_phase(state: dict[str, torch.Tensor], groups: dict[str, list[str]], threads: int) -> dict:
    jobs = []  # (group, name, chunk, itemsize)
    for key, names in groups.items():
        for name in names:
            t = state[name]
            jobs += [(key, name, c, t.element_size()) for c in chunks_of(t)]
    raw_by_group: dict[str, int] = defaultdict(int)
    for key, _, c, _ in jobs:
        raw_by_group[key] += len(c)
    out = {}
    with ThreadPoolExecutor(threads) as pool:
        for setting, (cname, clevel, shuffle, blocksize, what) in SETTINGS.items():
            gc.collect()

            def enc(job, cname=cname, clevel=clevel, shuffle=shuffle, blocksize=blocksize):
                return blosc.compress(job[2], cname.encode(), clevel, shuffle, blocksize, job[3])

            t0 = time.perf_counter()
            frames = list(pool.map(enc, jobs))
            enc_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            decoded = sum(len(d) for d in pool.map(blosc.decompress, frames))
            dec_s = time.perf_counter() - t0
            assert decoded == sum(raw_by_group.values())
            by_group: dict[str, int] = defaultdict(int)
            for job, frame in zip(jobs, frames):
                by_group[job[0]] += len(frame)
            del frames
            total_raw, total = sum(raw_by_group.values()), sum(by_group.values())
            out[setting] = {
                "what": what,
                "encode_s": enc_s,
                "decode_s": dec_s,
                "encode_gb_per_s": total_raw / enc_s / 1e9,
                "decode_gb_per_s": total_raw / dec_s / 1e9,
                "bytes": dict(by_group),
                "ratio": {k: raw_by_group[k] / by_group[k] for k in by_group},
                "ratio_all": total_raw / total,
            }
            print(f"  codec {setting}: ratio {total_raw / total:.4f}, encode {enc_s:.2f} s, decode {dec_s:.2f} s")
    return {"raw_bytes": dict(raw_by_group), "threads": threads, "chunk_bytes": INNER_CHUNK_BYTES, "settings": out}


# -- 4. sizes ------------------------------------------------------------------------------------------------------
def run_timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, exit code and the last line printed of a command."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    said = (p.stdout + p.stderr).strip().splitlines()
    return wall, p.returncode, said[-1] if said else ""


def sizes_phase(ckpt: str, packed: str, back: str | None, tensors: dict, groups: dict[str, list[str]]) -> dict:
    drop = drop_caches()
    to_s, to_rc, to_msg = run_timed(cli("reshard", ckpt, packed, "--compress", BLOSC))
    if to_rc:
        raise SystemExit(f"reshard to blosc-zstd failed: {to_msg}")
    diff_s, diff_rc, diff_msg = run_timed(cli("diff", ckpt, packed))
    back_run = None
    if back is not None:
        drop_caches()
        back_s, back_rc, back_msg = run_timed(cli("reshard", packed, back, "--compress", NONE))
        back_bytes = dir_bytes(back) if back_rc == 0 else None
        shutil.rmtree(back, ignore_errors=True)
        back_run = {"wall_s": back_s, "rc": back_rc, "said": back_msg, "bytes": back_bytes}
    names = set(tensors)
    raw, comp = array_bytes(ckpt, names), array_bytes(packed, names)
    per_group = {}
    for key, members in groups.items():
        r, c = sum(raw[n] for n in members), sum(comp[n] for n in members)
        logical = sum(tensors[n].nbytes for n in members)
        per_group[key] = {"logical_bytes": logical, "raw_bytes": r, "compressed_bytes": c, "ratio": r / c}
    total_raw, total_comp = dir_bytes(ckpt), dir_bytes(packed)
    return {
        "page_cache_before_reshard": drop,
        "reshard_to_compressed": {"wall_s": to_s, "rc": to_rc, "said": to_msg},
        "diff": {"wall_s": diff_s, "rc": diff_rc, "said": diff_msg},
        "reshard_back_uncompressed": back_run,
        "groups": per_group,
        "checkpoint_bytes_uncompressed": total_raw,
        "checkpoint_bytes_compressed": total_comp,
        "ratio_all": total_raw / total_comp,
    }


# -- 5. timing -----------------------------------------------------------------------------------------------------
def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(np.array_equal(raw_bytes(a[n]), raw_bytes(b[n])) for n in a)


def timing_phase(state: dict[str, torch.Tensor], work: str, reps: int, settle: float, results: Results) -> dict:
    target = {n: torch.empty_like(t) for n, t in state.items()}
    rows = []
    checked = {}
    # one untimed round over the smallest tensors (about 1% of the bytes) of each setting first: the first save
    # and load of a process pay for imports, thread pools and allocator growth that later ones do not
    small, acc = {}, 0
    for n in sorted(state, key=lambda n: state[n].nbytes):
        if acc + state[n].nbytes > 0.01 * sum(t.nbytes for t in state.values()):
            break
        small[n], acc = state[n], acc + state[n].nbytes
    for compress in (NONE, BLOSC):
        path = os.path.join(work, f"warmup-{compress}")
        shutil.rmtree(path, ignore_errors=True)
        moeckpt.save(small, path, format="zarr", compress=compress)
        moeckpt.load({n: target[n] for n in small}, path)
        shutil.rmtree(path)
    out = {"reps": rows, "equal_after_load": checked, "settle_s": settle, "warmup_tensors": len(small)}
    results.data["timing"] = out
    for rep in range(reps):
        order = (NONE, BLOSC) if rep % 2 == 0 else (BLOSC, NONE)
        for compress in order:
            path = os.path.join(work, f"save-{compress}")
            shutil.rmtree(path, ignore_errors=True)
            cache = drop_caches()
            time.sleep(settle)
            gc.collect()
            c0, t0 = cpu_s(), time.perf_counter()
            moeckpt.save(state, path, format="zarr", compress=compress)
            save_s, save_cpu = time.perf_counter() - t0, cpu_s() - c0
            stored = dir_bytes(path)
            drop_caches()
            time.sleep(settle)
            gc.collect()
            c0, t0 = cpu_s(), time.perf_counter()
            moeckpt.load(target, path)
            cold_s, cold_cpu = time.perf_counter() - t0, cpu_s() - c0
            gc.collect()
            c0, t0 = cpu_s(), time.perf_counter()
            moeckpt.load(target, path)
            warm_s, warm_cpu = time.perf_counter() - t0, cpu_s() - c0
            if compress not in checked:
                checked[compress] = same(state, target)
            for t in target.values():  # poison: the next load must write every element again
                if t.numel():
                    t.reshape(-1).view(torch.uint8).fill_(0xA5)
            row = {
                "rep": rep + 1,
                "compress": compress,
                "first_in_rep": compress == order[0],
                "page_cache_before_save": cache,
                "save_s": save_s,
                "save_cpu_s": save_cpu,
                "load_cold_s": cold_s,
                "load_cold_cpu_s": cold_cpu,
                "load_warm_s": warm_s,
                "load_warm_cpu_s": warm_cpu,
                "stored_bytes": stored,
            }
            rows.append(row)
            results.save()
            print(
                f"  rep {rep + 1} {compress:10s} save {save_s:6.3f} s (cpu {save_cpu:6.2f}), load cold {cold_s:6.3f} "
                f"s (cpu {cold_cpu:6.2f}), warm {warm_s:6.3f} s, {stored / 1e9:.3f} GB",
                flush=True,
            )
    for compress in (NONE, BLOSC):
        shutil.rmtree(os.path.join(work, f"save-{compress}"), ignore_errors=True)
    return out


# -- 6. tensorstore ------------------------------------------------------------------------------------------------
def tensorstore_phase(packed: str, state: dict[str, torch.Tensor], tensors: dict, largest_only: bool = False) -> dict:
    """tensorstore's reading of CKPT-z's arrays (every one, or the largest of each dtype), byte for byte against the
    trained state: the target is that a second zarr v3 reader reads every compressed array equal."""
    try:
        import tensorstore as ts
    except ImportError as e:
        return {"skipped": f"tensorstore not importable: {e}"}
    names = sorted(tensors)
    if largest_only:
        picks: dict[str, str] = {}
        for name, entry in tensors.items():
            if entry.dtype not in picks or entry.nbytes > tensors[picks[entry.dtype]].nbytes:
                picks[entry.dtype] = name
        names = sorted(picks.values())
    out: dict = {"version": importlib.metadata.version("tensorstore"), "arrays": [], "read": "largest of each dtype"
                 if largest_only else "every array"}  # fmt: skip
    t_all = time.perf_counter()
    for name in names:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(packed, name) + "/"}}
        t0 = time.perf_counter()
        got = np.asarray(ts.open(spec, read=True).result().read().result())
        wall = time.perf_counter() - t0
        mine = raw_bytes(state[name])
        flat = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
        equal = tuple(got.shape) == tuple(state[name].shape) and np.array_equal(flat, mine)
        out["arrays"].append(
            {"name": name, "dtype": tensors[name].dtype, "bytes": int(got.nbytes), "equal": bool(equal),
             "read_s": round(wall, 4)}
        )  # fmt: skip
        if largest_only or not equal:
            print(f"  tensorstore {name} ({tensors[name].dtype}, {got.nbytes / 1e6:.1f} MB): equal={equal}")
    out["all_equal"] = all(a["equal"] for a in out["arrays"])
    out["arrays_read"] = len(out["arrays"])
    out["bytes_read"] = sum(a["bytes"] for a in out["arrays"])
    out["read_s"] = round(time.perf_counter() - t_all, 2)
    print(
        f"  tensorstore read {out['arrays_read']} arrays ({out['bytes_read'] / 1e9:.2f} GB) in {out['read_s']} s: "
        f"all equal={out['all_equal']}"
    )
    return out


# -- summary -------------------------------------------------------------------------------------------------------
def summarize(data: dict) -> dict:
    """Targets and the S3 model from the measurements (also for a partial run: what is missing is left out)."""
    s: dict = {}
    sizes = data.get("sizes")
    if sizes:
        params = [g for k, g in sizes["groups"].items() if k.startswith("param bfloat16")]
        if params:
            r = params[0]["ratio"]
            s["param_bf16_ratio"] = {"value": r, "target": TARGETS["param_ratio"], "met": r >= TARGETS["param_ratio"]}
        r = sizes["ratio_all"]
        s["state_ratio"] = {"value": r, "target": TARGETS["state_ratio"], "met": r >= TARGETS["state_ratio"]}
    timing = data.get("timing")
    if timing and timing["reps"]:
        by = defaultdict(dict)
        for row in timing["reps"]:
            by[row["rep"]][row["compress"]] = row
        pairs = [v for _, v in sorted(by.items()) if NONE in v and BLOSC in v]
        cores = data["machine"]["cores"]
        for what in ("save_s", "load_cold_s", "load_warm_s"):
            ratios = [p[BLOSC][what] / p[NONE][what] for p in pairs]
            med = statistics.median(p[BLOSC][what] for p in pairs) / statistics.median(p[NONE][what] for p in pairs)
            s[f"{what}_ratio"] = {
                "per_rep": ratios,
                "of_medians": med,
                "target": TARGETS["time_ratio"],
                "met_of_medians": med <= TARGETS["time_ratio"],
                "met_every_rep": all(r <= TARGETS["time_ratio"] for r in ratios),
            }
        model = {}
        for gbit in S3_GBIT:
            bw = gbit / 8 * 1e9
            for op, cpu_key in (("upload", "save_cpu_s"), ("download", "load_cold_cpu_s")):
                rows = {}
                for c in (NONE, BLOSC):
                    serial = [p[c]["stored_bytes"] / bw + p[c][cpu_key] / cores for p in pairs]
                    overlap = [max(p[c]["stored_bytes"] / bw, p[c][cpu_key] / cores) for p in pairs]
                    rows[c] = {"serial_s": serial, "overlapped_s": overlap}
                bytes_ratio = statistics.median(p[NONE]["stored_bytes"] / p[BLOSC]["stored_bytes"] for p in pairs)
                model[f"{op} {gbit:g} Gbit/s"] = {
                    **rows,
                    "speedup_serial": [a / b for a, b in zip(rows[NONE]["serial_s"], rows[BLOSC]["serial_s"])],
                    "speedup_overlapped": [
                        a / b for a, b in zip(rows[NONE]["overlapped_s"], rows[BLOSC]["overlapped_s"])
                    ],
                    "bytes_ratio": bytes_ratio,
                }
        s["s3_model"] = model
    ts_ = data.get("tensorstore")
    if ts_ and "all_equal" in ts_:
        s["tensorstore_equal"] = ts_["all_equal"]
    return s


# -- report --------------------------------------------------------------------------------------------------------
def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1.4, 1.0, 1.3]})
    ent, codecs = data.get("entropy", {}).get("groups", {}), data.get("codecs", {}).get("settings", {})
    sizes = data.get("sizes", {}).get("groups", {})
    keys = [k for k in group_order(ent) if ent[k]["elements"] > 1000]
    ax = axes[0]
    bars = [("order-0 bound, pooled", lambda k: ent[k]["bound_bits_per_element_pooled"], "#bbbbbb")]
    bars.append(("order-0 bound, per tensor", lambda k: ent[k]["bound_bits_per_element_per_tensor"], "#888888"))
    if sizes:
        bars.append(("as written (on disk)", lambda k: ent[k]["bits_per_element_raw"] / sizes[k]["ratio"], "#1f77b4"))
    colors = {"zstd3": "#ff7f0e", "bitshuffle": "#2ca02c", "lz4": "#d62728"}
    for name, c in colors.items():
        if name in codecs:
            bars.append((codecs[name]["what"].replace("blosc ", ""), lambda k, n=name: bits_of(ent, codecs, n, k), c))
    width = 0.8 / len(bars)
    for i, (label, fn, color) in enumerate(bars):
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [fn(k) / ent[k]["bits_per_element_raw"] for k in keys], width, label=label, color=color)
    ax.set_xticks(range(len(keys)), [k.replace(" ", "\n") for k in keys], fontsize=8)
    ax.set_ylabel("stored size / raw size")
    ax.set_ylim(0, 1.05)
    ax.axhline(1, color="k", lw=0.5)
    ax.set_title("Per role: bytes against the entropy bound", fontsize=9)
    ax.legend(fontsize=6.5, loc="lower left")

    ax = axes[1]
    for j, k in enumerate(keys):
        per = ent[k]["entropy_per_byte_position_bits"]
        bottom = 0.0
        for pos, h in enumerate(per):
            ax.bar(j, h, 0.6, bottom=bottom, color=plt.cm.viridis(pos / 3), edgecolor="w")
            ax.text(j, bottom + h / 2, f"b{pos}: {h:.2f}", ha="center", va="center", fontsize=6, color="w")
            bottom += h
        ax.plot([j - 0.3, j + 0.3], [ent[k]["bits_per_element_raw"]] * 2, "k--", lw=0.7)
    ax.set_xticks(range(len(keys)), [k.replace(" ", "\n") for k in keys], fontsize=8)
    ax.set_ylabel("bits per element (dashed: raw)")
    ax.set_title("Entropy of each byte position (b0 least significant)", fontsize=9)

    ax = axes[2]
    rows = data.get("timing", {}).get("reps", [])
    measures = ("save_s", "load_cold_s", "load_warm_s")
    for m_i, m in enumerate(measures):
        for c_i, (c, color) in enumerate(((NONE, "#999999"), (BLOSC, "#1f77b4"))):
            ys = [r[m] for r in rows if r["compress"] == c]
            xs = [m_i * 3 + c_i + (i - (len(ys) - 1) / 2) * 0.08 for i in range(len(ys))]
            ax.scatter(xs, ys, s=14, color=color, label=c if m_i == 0 else None, zorder=3)
            if ys:
                ax.plot([m_i * 3 + c_i - 0.3, m_i * 3 + c_i + 0.3], [statistics.median(ys)] * 2, color=color)
    ax.set_xticks([m_i * 3 + 0.5 for m_i in range(3)], ["save", "load (cold cache)", "load (warm cache)"], fontsize=8)
    ax.set_ylabel("seconds (every repetition; line: median)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    counts = ", ".join(f"{sum(r['compress'] == c for r in rows)} {c}" for c in (NONE, BLOSC))
    ax.set_title(f"moeckpt.save / load, local disk; repetitions: {counts}", fontsize=9)
    tr = data.get("train", {})
    fig.suptitle(
        f"{data['config']['model']} trained {tr.get('step', '?')} steps (bf16 + fp32 master + AdamW), "
        f"{data.get('state_bytes', 0) / 1e9:.2f} GB of state, zarr; {data['machine'].get('where', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bits_of(ent: dict, codecs: dict, setting: str, key: str) -> float:
    return ent[key]["bits_per_element_raw"] / codecs[setting]["ratio"][key]


def report(data: dict) -> str:
    """The run's tables in markdown (the doc's figures come from here)."""
    lines = []
    ent, codecs = data.get("entropy", {}).get("groups", {}), data.get("codecs", {}).get("settings", {})
    sizes = data.get("sizes", {}).get("groups", {})
    if ent:
        names = [n for n in SETTINGS if n in codecs]
        lines += [
            "| role, dtype | tensors | GB | entropy per byte position (bits, b0 first) | bound bits/elem pooled "
            "(best ratio) | per tensor (best ratio) | on disk ratio |" + "".join(f" {n} ratio |" for n in names),
            "| --- " * (7 + len(names)) + "|",
        ]
        for k in group_order(ent):
            e = ent[k]
            gb = e["elements"] * e["bits_per_element_raw"] / 8e9
            disk = f"{sizes[k]['ratio']:.3f}" if k in sizes else "-"
            cells = [f"{codecs[n]['ratio'][k]:.3f}" if k in codecs[n]["ratio"] else "-" for n in names]
            lines.append(
                f"| {k} | {e['tensors']} | {gb:.3f} | {', '.join(f'{h:.3f}' for h in e['entropy_per_byte_position_bits'])}"
                f" | {e['bound_bits_per_element_pooled']:.2f} ({e['bound_ratio_pooled']:.3f}x) | "
                f"{e['bound_bits_per_element_per_tensor']:.2f} ({e['bound_ratio_per_tensor']:.3f}x) | {disk} |"
                + "".join(f" {c} |" for c in cells)
            )
        lines.append("")
    if codecs:
        lines.append("| setting | whole state ratio | encode s (GB/s) | decode s (GB/s) |")
        lines.append("| --- | --- | --- | --- |")
        for n in names:
            c = codecs[n]
            lines.append(
                f"| {n}: {c['what']} | {c['ratio_all']:.4f} | {c['encode_s']:.2f} ({c['encode_gb_per_s']:.2f}) | "
                f"{c['decode_s']:.2f} ({c['decode_gb_per_s']:.2f}) |"
            )
        lines.append("")
    if data.get("sizes"):
        sz = data["sizes"]
        lines.append(
            f"checkpoint on disk: {sz['checkpoint_bytes_uncompressed']:,} B uncompressed, "
            f"{sz['checkpoint_bytes_compressed']:,} B blosc-zstd: {sz['ratio_all']:.4f}x; reshard to blosc-zstd "
            f"{sz['reshard_to_compressed']['wall_s']:.2f} s, diff rc {sz['diff']['rc']} ({sz['diff']['said']})"
            + (
                f"; back to none {back['wall_s']:.2f} s (rc {back['rc']})"
                if (back := sz["reshard_back_uncompressed"])
                else ""
            )
        )
        lines.append("")
    rows = data.get("timing", {}).get("reps", [])
    if rows:
        lines.append(
            "| rep | setting (first?) | save s | save CPU s | load cold s | load cold CPU s | load warm s | "
            "load warm CPU s | stored GB |"
        )
        lines.append("| --- " * 9 + "|")
        for r in rows:
            lines.append(
                f"| {r['rep']} | {r['compress']}{' (first)' if r['first_in_rep'] else ''} | {r['save_s']:.3f} | "
                f"{r['save_cpu_s']:.2f} | {r['load_cold_s']:.3f} | {r['load_cold_cpu_s']:.2f} | {r['load_warm_s']:.3f}"
                f" | {r['load_warm_cpu_s']:.2f} | {r['stored_bytes'] / 1e9:.4f} |"
            )
        lines.append("")
    s = data.get("summary", {})
    for k in ("save_s_ratio", "load_cold_s_ratio", "load_warm_s_ratio"):
        if k in s:
            v = s[k]
            lines.append(
                f"{k}: per rep {', '.join(f'{x:.3f}' for x in v['per_rep'])}; of medians {v['of_medians']:.3f} "
                f"(target <= {v['target']}): of medians {'met' if v['met_of_medians'] else 'MISSED'}, every rep "
                f"{'met' if v['met_every_rep'] else 'MISSED'}"
            )
    for k, v in s.get("s3_model", {}).items():
        lines.append(
            f"S3 model {k}: none serial {fmt(v[NONE]['serial_s'])} s, blosc serial {fmt(v[BLOSC]['serial_s'])} s "
            f"(speedup {fmt(v['speedup_serial'])}); overlapped none {fmt(v[NONE]['overlapped_s'])}, blosc "
            f"{fmt(v[BLOSC]['overlapped_s'])} (speedup {fmt(v['speedup_overlapped'])}); bytes ratio "
            f"{v['bytes_ratio']:.4f}"
        )
    for k in ("param_bf16_ratio", "state_ratio"):
        if k in s:
            lines.append(f"{k}: {s[k]['value']:.4f} (target >= {s[k]['target']}): {'met' if s[k]['met'] else 'MISSED'}")
    if "tensorstore" in data:
        ts_summary = {k: v for k, v in data["tensorstore"].items() if k != "arrays"}
        lines.append(f"tensorstore: {json.dumps(ts_summary)}")
    return "\n".join(lines)


def fmt(xs: list[float]) -> str:
    return ", ".join(f"{x:.3f}" for x in xs)


# -- main ----------------------------------------------------------------------------------------------------------
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="zaya-small", help="trainer preset (default zaya-small)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--train-timeout", type=float, default=180.0, help="seconds before SIGTERM (save and stop)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU (a quick check)")
    p.add_argument("--ckpt", help="skip training: measure this committed zarr checkpoint (uncompressed)")
    p.add_argument("--reps", type=int, default=5, help="save/load repetitions of each setting")
    p.add_argument("--settle", type=float, default=0.5, help="seconds of quiet after each page-cache drop")
    p.add_argument("--work", default="/var/tmp/bench_compress", help="scratch directory on the disk measured")
    p.add_argument("--out", default="docs/benchmarks", help="where compress.json and compress.png go")
    p.add_argument("--where", default="", help="a few words on the machine, for the plot's title")
    p.add_argument(
        "--tensorstore-largest", action="store_true", help="tensorstore reads only the largest array of each dtype"
    )
    p.add_argument("--skip", default="", help="phases to skip, comma-separated (codecs,sizes,timing,tensorstore)")
    p.add_argument("--reshard-back", action="store_true", help="also time a reshard of CKPT-z back to none")
    p.add_argument("--report", metavar="JSON", help="print the tables of a run's JSON and redraw its plot")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        data["summary"] = summarize(data)
        print(report(data))
        plot(data, os.path.join(os.path.dirname(args.report), "compress.png"))
        return
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    cores = len(os.sched_getaffinity(0))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu else None
    data: dict = {
        "started": now(),
        "argv": shlex.join(["python", *sys.argv]),
        "config": vars(args),
        "machine": {
            "cores": cores,
            "cpu": sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip(),
            "mem_total": sh("grep MemTotal /proc/meminfo"),
            "gpu": gpu,
            "torch": torch.__version__,
            "numcodecs": __import__("numcodecs").__version__,
            "blosc": blosc.VERSION_STRING if hasattr(blosc, "VERSION_STRING") else "?",
            "python": platform.python_version(),
            "kernel": platform.release(),
            "disk": sh(f"df -hT {shlex.quote(args.work)} | tail -1"),
            "where": args.where,
        },
    }
    results = Results(os.path.join(args.out, "compress.json"), data)
    results.save()
    run_dir = os.path.join(args.work, "run")
    if args.ckpt:
        ckpt = args.ckpt
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"[{now()}] train", flush=True)
        data["train"] = train(args, run_dir)
        shutil.copy(os.path.join(args.work, "train.log"), os.path.join(args.out, "compress_train.log"))
        ckpt = data["train"]["checkpoint"]
        results.save()
    reader = CheckpointReader(ckpt)
    tensors = reader.index.tensors
    groups: dict[str, list[str]] = defaultdict(list)
    for name, e in sorted(tensors.items()):
        groups[group_key(e.role, e.dtype)].append(name)
    groups = {k: groups[k] for k in group_order(groups)}
    print(f"[{now()}] read {ckpt}", flush=True)
    t0 = time.perf_counter()
    state = {name: reader.read_tensor(name) for name in tensors}
    data["read_s"] = time.perf_counter() - t0
    data["state_bytes"] = sum(e.nbytes for e in tensors.values())
    data["tensors"] = len(tensors)
    data["groups"] = {k: {"tensors": len(v), "bytes": sum(tensors[n].nbytes for n in v)} for k, v in groups.items()}
    print(f"  {len(tensors)} tensors, {data['state_bytes'] / 1e9:.3f} GB in {data['read_s']:.1f} s", flush=True)

    print(f"[{now()}] entropy", flush=True)
    data["entropy"] = entropy_phase(state, groups, "cuda" if gpu else "cpu")
    results.save()
    packed = os.path.join(args.work, "ckpt-z")
    if "sizes" not in skip:
        print(f"[{now()}] sizes (reshard)", flush=True)
        shutil.rmtree(packed, ignore_errors=True)
        back = os.path.join(args.work, "ckpt-back") if args.reshard_back else None
        data["sizes"] = sizes_phase(ckpt, packed, back, tensors, groups)
        results.save()
    if "tensorstore" not in skip and os.path.isdir(packed):
        print(f"[{now()}] tensorstore", flush=True)
        data["tensorstore"] = tensorstore_phase(packed, state, tensors, args.tensorstore_largest)
        results.save()
    if "timing" not in skip:
        print(f"[{now()}] timing ({args.reps} reps)", flush=True)
        data["timing"] = timing_phase(state, args.work, args.reps, args.settle, results)
    if "codecs" not in skip:
        print(f"[{now()}] codecs", flush=True)
        data["codecs"] = codec_phase(state, groups, cores)
        results.save()
    data["finished"] = now()
    data["summary"] = summarize(data)
    results.save()
    print(report(data), flush=True)
    try:
        plot(data, os.path.join(args.out, "compress.png"))
    except ImportError as e:  # no matplotlib: redraw later with --report
        print(f"(no plot: {e})")


if __name__ == "__main__":
    main()
