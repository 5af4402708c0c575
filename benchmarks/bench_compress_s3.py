"""S3 benchmark of ``--compress`` (issue 32's S3 target), measured: ``moeckpt.save`` and ``moeckpt.load`` of a
trained state to a real S3 protocol server (moto, in its own process) through a bandwidth-capped TCP proxy
(:mod:`throttle_proxy`, in its own process too), uncompressed against blosc-zstd, side by side in one run.

The target: on a network-bound S3 "faster than uncompressed in proportion to the bytes saved", i.e.
``time(none) / time(blosc-zstd) ~ bytes(none) / bytes(blosc-zstd)``.

The state: every tensor of a committed zarr checkpoint (``--ckpt``: one the bundled trainer wrote), read into
memory once. Conditions: ``direct`` (s3fs to moto on loopback, no proxy) and one per ``--caps`` entry (MB/s, the
same cap in each direction, shared by all connections). Each repetition runs every condition (their order rotating)
and in each both settings (their order alternating between repetitions): a save to a fresh prefix, then a load of
it into preallocated tensors (poisoned before, compared with the state byte for byte after), then the prefix is
deleted. Recorded for each operation: wall seconds; CPU seconds of this process, of the moto server and of the
proxy; bytes stored (the objects listed after the save); bytes through the proxy in each direction (HTTP
included). One untimed save and load of the smallest tensors (about 1% of the bytes) per setting comes first.

    python benchmarks/bench_compress_s3.py --ckpt RUN --max-gb 0.6 --caps 40,80 --reps 5
    python benchmarks/bench_compress_s3.py --report docs/benchmarks/compress_s3.json   # tables and the plot
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from collections import defaultdict

import torch

import moeckpt
import moeckpt.reshard.options as load_options
from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.formats.storages import open_storage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_storage import BUCKET, start_moto  # benchmarks/ is on sys.path from here on
from throttle_proxy import ProxyProcess

NONE, BLOSC = "none", "blosc-zstd"
DIRECT = "direct"
MB = 1_000_000
TICKS = os.sysconf("SC_CLK_TCK")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process so far (``/proc/PID/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "?"


def condition_name(cap_mb: float | None) -> str:
    return DIRECT if cap_mb is None else f"{cap_mb:g} MB/s"


class Bench:
    """The moto server, the proxy, the state and the preallocated targets of one run."""

    def __init__(self, state: dict[str, torch.Tensor], fill_threads: list[int] | None = None) -> None:
        self.state = state
        self.fill_threads = fill_threads
        self.target = {n: torch.empty_like(t) for n, t in state.items()}
        self.moto, self.moto_endpoint = start_moto()
        host, port = self.moto_endpoint.rsplit("/", 1)[1].split(":")
        self.proxy = ProxyProcess.start((host, int(port)))

    def close(self) -> None:
        self.proxy.close()
        self.moto.stop()

    def use(self, cap_mb: float | None) -> None:
        """Point s3fs at moto directly (``None``) or through the proxy capped at ``cap_mb`` MB/s each way."""
        if cap_mb is None:
            os.environ["AWS_ENDPOINT_URL_S3"] = self.moto_endpoint
        else:
            self.proxy.set_caps(cap_mb * MB, cap_mb * MB)
            os.environ["AWS_ENDPOINT_URL_S3"] = self.proxy.endpoint

    def counters(self) -> tuple[float, float, float, int, int]:
        s = self.proxy.stats()
        return own_cpu_s(), proc_cpu_s(self.moto.pid), proc_cpu_s(self.proxy.proc.pid), s["bytes_up"], s["bytes_down"]

    def timed(self, op) -> dict:
        gc.collect()
        c0 = self.counters()
        t0 = time.perf_counter()
        op()
        wall = time.perf_counter() - t0
        c1 = self.counters()
        return {
            "wall_s": wall,
            "cpu_s": c1[0] - c0[0],
            "moto_cpu_s": c1[1] - c0[1],
            "proxy_cpu_s": c1[2] - c0[2],
            "wire_up_bytes": c1[3] - c0[3],
            "wire_down_bytes": c1[4] - c0[4],
            "load_average_1m_after": os.getloadavg()[0],
        }

    def poison(self) -> None:
        for t in self.target.values():
            if t.numel():
                t.reshape(-1).view(torch.uint8).fill_(0xA5)

    def one(self, url: str, compress: str, names: list[str] | None = None) -> dict:
        """Save to ``url``, load it back, check it, delete it; the figures of both operations."""
        state = self.state if names is None else {n: self.state[n] for n in names}
        target = self.target if names is None else {n: self.target[n] for n in names}
        storage = open_storage(url)
        save = self.timed(lambda: moeckpt.save(state, url, format="zarr", compress=compress))
        stored = sum(storage.list_files().values())
        self.poison()
        load = self.timed(lambda: moeckpt.load(target, url))
        equal = all(torch.equal(state[n].view(torch.uint8), target[n].view(torch.uint8)) for n in state)
        row = {"save": save, "load": load, "stored_bytes": stored, "equal": equal}
        if self.fill_threads and names is None:
            # the load again with other numbers of fill threads (LoadOptions.fill_threads, by default the
            # rank's share of the cores), through the default's own hook
            row["load_by_fill_threads"] = {}
            default = load_options.cores_per_rank
            try:
                for n in self.fill_threads:
                    load_options.cores_per_rank = lambda n=n: n
                    self.poison()
                    got = self.timed(lambda: moeckpt.load(target, url))
                    got["equal"] = all(
                        torch.equal(state[k].view(torch.uint8), target[k].view(torch.uint8)) for k in state
                    )
                    row["load_by_fill_threads"][str(n)] = got
            finally:
                load_options.cores_per_rank = default
        storage.remove()
        return row


def read_state(ckpt: str, max_gb: float | None = None) -> tuple[str, dict[str, torch.Tensor], dict]:
    """Every tensor of the checkpoint; with ``max_gb``, the parameters in name order with all their optimizer
    tensors (so every role keeps its share) while the total stays within ``max_gb``."""
    steps = committed_steps(ckpt)
    if steps:  # a run directory: its newest step
        ckpt = steps[-1][1].location
    reader = CheckpointReader(ckpt)
    tensors = reader.index.tensors
    by_param: dict[str, list[str]] = defaultdict(list)
    for name, e in sorted(tensors.items()):
        by_param[e.param or name].append(name)
    names: list[str] = []
    acc = 0
    for param in sorted(by_param):
        more = sum(tensors[n].nbytes for n in by_param[param])
        if max_gb is not None and acc + more > max_gb * 1e9:
            continue
        names += by_param[param]
        acc += more
    state = {name: reader.read_tensor(name) for name in names}
    groups: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    for e in (tensors[n] for n in names):
        g = groups[f"{e.role} {e.dtype}"]
        g["tensors"] += 1
        g["bytes"] += e.nbytes
    info = {
        "checkpoint": ckpt,
        "step": reader.index.step,
        "model": reader.index.model,
        "tensors": len(state),
        "tensors_in_checkpoint": len(tensors),
        "bytes_in_checkpoint": sum(e.nbytes for e in tensors.values()),
        "max_gb": max_gb,
        "bytes": sum(t.nbytes for t in state.values()),
        "groups": dict(groups),
    }
    return ckpt, state, info


def run(args: argparse.Namespace, out_json: str) -> dict:
    ckpt, state, info = read_state(args.ckpt, args.max_gb)
    caps: list[float | None] = [None, *(float(c) for c in args.caps.split(",") if c)]
    data: dict = {
        "started": now(),
        "argv": shlex.join(["python", *sys.argv]),
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "cpu": cpu_model(),
            "load_average_at_start": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "moto": importlib.metadata.version("moto"),
            "s3fs": importlib.metadata.version("s3fs"),
            "botocore": importlib.metadata.version("botocore"),
            "kernel": platform.release(),
        },
        "state": info,
        "conditions": [condition_name(c) for c in caps],
        "reps": [],
    }

    def save() -> None:
        tmp = out_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, out_json)

    print(f"[{now()}] {info['tensors']} tensors, {info['bytes'] / 1e9:.3f} GB from {ckpt}", flush=True)
    fill = [int(n) for n in args.fill_threads.split(",")] if args.fill_threads else None
    data["fill_threads"] = fill
    bench = Bench(state, fill)
    try:
        small, acc = [], 0
        for n in sorted(state, key=lambda n: state[n].nbytes):
            if acc + state[n].nbytes > 0.01 * info["bytes"]:
                break
            small.append(n)
            acc += state[n].nbytes
        for cap in caps:
            bench.use(cap)
            for compress in (NONE, BLOSC):
                bench.one(f"s3://{BUCKET}/warmup-{compress}", compress, small)
        for rep in range(args.reps):
            order = (NONE, BLOSC) if rep % 2 == 0 else (BLOSC, NONE)
            conds = caps[rep % len(caps) :] + caps[: rep % len(caps)]
            for cap in conds:
                bench.use(cap)
                for compress in order:
                    row = bench.one(f"s3://{BUCKET}/rep{rep + 1}-{compress}", compress)
                    row.update(
                        rep=rep + 1, condition=condition_name(cap), cap_mb_s=cap, compress=compress,
                        first_in_rep=compress == order[0],
                    )  # fmt: skip
                    data["reps"].append(row)
                    save()
                    for n, got in row.get("load_by_fill_threads", {}).items():
                        print(f"    load with {n} fill threads {got['wall_s']:6.2f} s (cpu {got['cpu_s']:5.1f})")
                    s, ld = row["save"], row["load"]
                    print(
                        f"  rep {rep + 1} {condition_name(cap):>10s} {compress:10s} save {s['wall_s']:6.2f} s "
                        f"(cpu {s['cpu_s']:5.1f}, moto {s['moto_cpu_s']:5.1f}, proxy {s['proxy_cpu_s']:4.1f})  "
                        f"load {ld['wall_s']:6.2f} s (cpu {ld['cpu_s']:5.1f}, moto {ld['moto_cpu_s']:5.1f}, "
                        f"proxy {ld['proxy_cpu_s']:4.1f})  stored {row['stored_bytes'] / 1e9:.3f} GB  "
                        f"equal {row['equal']}",
                        flush=True,
                    )
    finally:
        bench.close()
    data["finished"] = now()
    data["summary"] = summarize(data)
    save()
    return data


def summarize(data: dict) -> dict:
    """Per condition and operation: time ratios none / blosc-zstd per repetition and of the medians, against the
    bytes ratios (stored, and on the wire when the proxy counted them)."""
    by: dict[tuple[str, int], dict[str, dict]] = defaultdict(dict)
    for row in data["reps"]:
        by[(row["condition"], row["rep"])][row["compress"]] = row
    out: dict = {}
    for cond in data["conditions"]:
        pairs = [v for (c, _), v in sorted(by.items()) if c == cond and NONE in v and BLOSC in v]
        if not pairs:
            continue
        stored = statistics.median(p[NONE]["stored_bytes"] / p[BLOSC]["stored_bytes"] for p in pairs)
        s: dict = {"pairs": len(pairs), "stored_bytes_ratio": stored}
        for op, wire in (("save", "wire_up_bytes"), ("load", "wire_down_bytes")):
            ratios = [p[NONE][op]["wall_s"] / p[BLOSC][op]["wall_s"] for p in pairs]
            med = {c: statistics.median(p[c][op]["wall_s"] for p in pairs) for c in (NONE, BLOSC)}
            wires = [p[NONE][op][wire] / p[BLOSC][op][wire] for p in pairs if p[BLOSC][op][wire]]
            rate = {
                c: statistics.median(p[c][op][wire] / p[c][op]["wall_s"] / MB for p in pairs if p[c][op][wire])
                if any(p[c][op][wire] for p in pairs)
                else None
                for c in (NONE, BLOSC)
            }
            s[op] = {
                "time_ratio_per_rep": ratios,
                "time_ratio_of_medians": med[NONE] / med[BLOSC],
                "median_wall_s": med,
                "wire_bytes_ratio": statistics.median(wires) if wires else None,
                "wire_mb_per_s_median": rate,
                "share_of_bytes_ratio": (med[NONE] / med[BLOSC]) / stored,
            }
        out[cond] = s
    return out


def report(data: dict) -> str:
    lines = [
        "| rep | condition | setting | save s | save CPU s (moeckpt, moto, proxy) | up MB | load s | "
        "load CPU s (moeckpt, moto, proxy) | down MB | stored GB | equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["reps"]:
        s, ld = r["save"], r["load"]
        first = " (first)" if r["first_in_rep"] else ""
        up = f"{s['wire_up_bytes'] / MB:.0f}" if s["wire_up_bytes"] else "-"
        down = f"{ld['wire_down_bytes'] / MB:.0f}" if ld["wire_down_bytes"] else "-"
        lines.append(
            f"| {r['rep']} | {r['condition']} | {r['compress']}{first} | {s['wall_s']:.2f} | "
            f"{s['cpu_s']:.1f}, {s['moto_cpu_s']:.1f}, {s['proxy_cpu_s']:.1f} | {up} | {ld['wall_s']:.2f} | "
            f"{ld['cpu_s']:.1f}, {ld['moto_cpu_s']:.1f}, {ld['proxy_cpu_s']:.1f} | {down} | "
            f"{r['stored_bytes'] / 1e9:.4f} | {r['equal']} |"
        )
    lines += [
        "",
        "| condition | op | time ratio none / blosc-zstd, per rep | of the medians | bytes ratio (stored) | "
        "share of the bytes ratio | median MB/s on the wire (none, blosc) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cond, s in data["summary"].items():
        for op in ("save", "load"):
            o = s[op]
            rate = o["wire_mb_per_s_median"]
            rates = "-" if rate[NONE] is None else f"{rate[NONE]:.0f}, {rate[BLOSC]:.0f}"
            lines.append(
                f"| {cond} | {op} | {', '.join(f'{x:.3f}' for x in o['time_ratio_per_rep'])} | "
                f"{o['time_ratio_of_medians']:.3f} | {s['stored_bytes_ratio']:.3f} | "
                f"{o['share_of_bytes_ratio']:.2f} | {rates} |"
            )
    return "\n".join(lines)


def plot(data: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conds = data["conditions"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, op in zip(axes, ("save", "load")):
        for i, cond in enumerate(conds):
            for j, (c, color) in enumerate(((NONE, "tab:gray"), (BLOSC, "tab:blue"))):
                ys = [r[op]["wall_s"] for r in data["reps"] if r["condition"] == cond and r["compress"] == c]
                ax.scatter([i + (j - 0.5) * 0.25] * len(ys), ys, color=color, s=18, label=c if i == 0 else None)
            s = data["summary"].get(cond)
            if s:  # where blosc-zstd would be if its time shrank with its bytes
                ideal = s[op]["median_wall_s"][NONE] / s["stored_bytes_ratio"]
                ax.plot(
                    [i, i + 0.25],
                    [ideal, ideal],
                    color="tab:green",
                    lw=2,
                    label="none / bytes ratio" if i == 0 else None,
                )
        ax.set_xticks(range(len(conds)), conds)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("seconds")
        ax.set_title(f"moeckpt.{op} to S3 (moto), every repetition")
        ax.legend(fontsize=8)
    gb = data["state"]["bytes"] / 1e9
    fig.suptitle(
        f"{gb:.2f} GB trained state, {data['machine']['cores']} cores: uncompressed vs blosc-zstd", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt", help="a committed uncompressed zarr checkpoint (or its run directory)")
    p.add_argument("--max-gb", type=float, help="measure only whole parameters (with their optimizer state) up to this")
    p.add_argument("--caps", default="40,80", help="proxy caps, MB/s each way, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--fill-threads", help="also time each load with these fill threads (comma-separated): a probe")
    p.add_argument("--out", default="docs/benchmarks", help="where compress_s3.json and compress_s3.png go")
    p.add_argument("--report", metavar="JSON", help="print the tables of a run's JSON and redraw its plot")
    args = p.parse_args()
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        data["summary"] = summarize(data)
    else:
        if not args.ckpt:
            p.error("--ckpt is required (or --report)")
        os.makedirs(args.out, exist_ok=True)
        data = run(args, os.path.join(args.out, "compress_s3.json"))
    print(report(data))
    plot(data, os.path.join(os.path.dirname(args.report) if args.report else args.out, "compress_s3.png"))


if __name__ == "__main__":
    main()
