"""Where a staged device load's time goes: each fill thread's time reading and verifying, waiting for a staging
buffer's copies to end, and handing copies to its stream, for each case of ``bench_load_gpu.py``, over a grid of
fill threads and stage sizes (issue 36). Parts copied from page-locked mappings are timed by step too: mapping and
verifying (``map_verify``), registering and unregistering with the driver, handing the copy over (with the
releases of earlier mappings it runs: ``mapped_enqueue``), and the end-of-load wait (``finish``).

Uses the checkpoints a ``bench_load_gpu.py --keep`` run left in ``--dir`` (every case's stored layout). For each
(threads, stage MiB) of the grid and each case, ``--reps`` loads of one rank into preallocated device tensors, each
timed whole and by phase (the staging class's methods wrapped with timers; the wrappers cost a few microseconds a
part), beside the raw read of the same files (``bench_load_gpu.raw_read``). Prints one line per load and writes
``OUT/load_gpu_phases.json``.

    python benchmarks/bench_load_gpu.py --reps 1 --methods raw --keep --dir /tmp/blg --out /tmp/x
    python benchmarks/probe_load_gpu_phases.py --dir /tmp/blg --out $OUT --grid 8:16,16:16,16:8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import sys
import threading
import time
from collections import defaultdict

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backends import block_checks, safetensors
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.checksum import checksum
from moeckpt.formats.errors import ChecksumMismatchError
from moeckpt.formats.storages.local import LocalFiles
from moeckpt.reshard import page_lock, staging
from moeckpt.reshard.load import LoadStats, load_rank_state
from moeckpt.reshard.options import LoadOptions
from moeckpt.reshard.planner import plan_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load_gpu import CASES, data_files, layout_name, raw_read, sync

PHASES = (
    "stager_init",
    "fill",
    "wait",
    "enqueue",
    "parts",
    "map_verify",
    "register",
    "unregister",
    "mapped_enqueue",
    "mapped_parts",
    "finish",
)


class Timers:
    """Per-thread phase totals of the loads since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_thread: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PHASES, 0.0))

    def add(self, phase: str, seconds: float) -> None:
        with self.lock:
            self.by_thread[threading.get_ident()][phase] += seconds

    def reset(self) -> dict[str, float]:
        with self.lock:
            rows = list(self.by_thread.values())
            self.by_thread.clear()
        total = {p: round(sum(r[p] for r in rows), 4) for p in PHASES}
        total["threads_seen"] = len(rows)
        return total


class _TimedEvent:
    def __init__(self, event, timers: Timers):
        self.event, self.timers = event, timers

    def synchronize(self) -> None:
        t = time.perf_counter()
        self.event.synchronize()
        self.timers.add("wait", time.perf_counter() - t)

    def record(self, stream) -> None:
        self.event.record(stream)


def instrument(timers: Timers) -> None:
    """Wrap :class:`staging.Stager`'s constructor, ``read``, ``copy_mapped`` and ``finish``, and the page-locked
    path's mapping (with its checksums), registration and release, with timers."""
    init, read = staging.Stager.__init__, staging.Stager.read
    copy_mapped, finish = staging.Stager.copy_mapped, staging.Stager.finish
    mapped_init = page_lock.MappedRows.__init__

    def timed(phase, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers.add(phase, time.perf_counter() - t)

        return wrapper

    class TimedRegistrar:
        def __init__(self, inner):
            self.register = timed("register", inner.register)
            self.unregister = timed("unregister", inner.unregister)

    def timed_mapped_init(self, map_rows_bytes, registrar):
        mapped_init(self, timed("map_verify", map_rows_bytes), TimedRegistrar(registrar))

    def timed_copy_mapped(self, host, release, dest):
        before = timers.by_thread[threading.get_ident()]["wait"]
        t = time.perf_counter()
        copy_mapped(self, host, release, dest)
        waited = timers.by_thread[threading.get_ident()]["wait"] - before
        timers.add("mapped_enqueue", time.perf_counter() - t - waited)
        timers.add("mapped_parts", 1)

    page_lock.MappedRows.__init__ = timed_mapped_init  # type: ignore[method-assign]
    staging.Stager.copy_mapped = timed_copy_mapped  # type: ignore[method-assign]
    staging.Stager.finish = timed("finish", finish)  # type: ignore[method-assign]

    def timed_init(self, nbytes, device):
        t = time.perf_counter()
        init(self, nbytes, device)
        if self.stream is not None:
            self.events = [_TimedEvent(e, timers) for e in self.events]
        timers.add("stager_init", time.perf_counter() - t)

    def timed_read(self, fill, dest):
        spent = [0.0]

        def timed_fill(stage):
            t = time.perf_counter()
            try:
                return fill(stage)
            finally:
                spent[0] += time.perf_counter() - t

        before = timers.by_thread[threading.get_ident()]["wait"]
        t = time.perf_counter()
        ok = read(self, timed_fill, dest)
        whole = time.perf_counter() - t
        waited = timers.by_thread[threading.get_ident()]["wait"] - before
        timers.add("fill", spent[0])
        timers.add("enqueue", whole - spent[0] - waited)
        timers.add("parts", 1)
        return ok

    staging.Stager.__init__ = timed_init  # type: ignore[method-assign]
    staging.Stager.read = timed_read  # type: ignore[method-assign]


_VERIFIERS = {
    (module, name): getattr(module, name)
    for module, names in (
        (safetensors, ("verify_blocks", "verify_columns")),
        (block_checks, ("verify_blocks", "slices_match")),
    )
    for name in names
}
_READ_VERIFIED = safetensors.SafetensorsReader._read_verified


def _read_unverified(self, ref, offset, parts, first_block) -> None:
    self._read_whole(ref, offset, parts)


def verify(on: bool) -> None:
    """Checksums computed as moeckpt does (``on``), or not at all: the safetensors backend's verifiers replaced by
    ones that pass without hashing, to measure what hashing costs a load."""
    for (module, name), fn in _VERIFIERS.items():
        setattr(module, name, fn if on else (lambda *a, **k: True))
    safetensors.SafetensorsReader._read_verified = _READ_VERIFIED if on else _read_unverified  # type: ignore[method-assign]


_ROWS_INTO = safetensors.SafetensorsReader.read_rows_into


def _mapped_rows_into(self, ref, lo, hi, out):
    """Rows ``[lo, hi)`` of ``ref`` into ``out`` from a mapping of the file: each checksum block hashed from the
    mapping (one read of it from memory), then copied into ``out`` while it is in the core's cache, instead of a
    ``pread`` into ``out`` and a second pass over ``out`` to hash it."""
    if ref.geometry is not None or not ref.box.ndim or hi <= lo or out.device.type != "cpu":
        return _ROWS_INTO(self, ref, lo, hi, out)
    row = ref.nbytes // ref.box.shape[0]
    a, b, block = lo * row, hi * row, ref.block_bytes
    if not block or a % block or (b % block and b != ref.nbytes) or out.numel() * out.element_size() != b - a:
        return _ROWS_INTO(self, ref, lo, hi, out)
    found = self._files.map(ref.file, ref.start + a, b - a)
    if found is None:
        return _ROWS_INTO(self, ref, lo, hi, out)
    mapped, at = found
    src = torch.frombuffer(mapped, dtype=torch.uint8, count=b - a, offset=at)
    dst = out.reshape(-1).view(torch.uint8)
    view = memoryview(mapped)
    first = a // block
    for i, off in enumerate(range(0, b - a, block)):
        end = min(off + block, b - a)
        if checksum(view[at + off : at + end]) != ref.checksums[first + i]:
            raise ChecksumMismatchError(f"{ref.tensor!r}: block {first + i} differs")
        dst[off:end].copy_(src[off:end])
    del src, view
    return True


def mapped_copy(on: bool) -> None:
    """The candidate read path (:func:`_mapped_rows_into`) for whole rows, or moeckpt's own."""
    safetensors.SafetensorsReader.read_rows_into = _mapped_rows_into if on else _ROWS_INTO


_MAP = LocalFiles.map


def _populated_map(self, relpath, offset, length, *, shared=False):
    """Shared mappings made with ``MAP_POPULATE`` (every page mapped by the ``mmap`` call itself)."""
    if not shared:
        return _MAP(self, relpath, offset, length, shared=shared)
    fd = self.fd(relpath)
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
    return mmap.mmap(fd, offset - base + length, flags=flags, prot=mmap.PROT_READ, offset=base), offset - base


def variants(flags: list[str]) -> None:
    """pop: shared mappings populated by ``mmap``."""
    LocalFiles.map = _populated_map if "pop" in flags else _MAP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/moeckpt-bench-load-gpu", help="where bench_load_gpu.py --keep saved")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--grid",
        default="8:16,16:16",
        help="comma-separated THREADS:STAGE_MIB[:FLAG...]; flags: nv, checksums not computed (an upper bound of what "
        "hashing costs; never how moeckpt loads); mN, LoadOptions.mapped_bytes N MiB (m0: every part staged); "
        "pop, shared mappings made with MAP_POPULATE; "
        "mc, whole rows hashed block by block from a mapping of the file, "
        "each block copied into the staging buffer while in the core's cache (a candidate read path, A/B only)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stage-host", action="store_true", help="with --device cpu: through the staged path on the host")
    args = ap.parse_args()
    staging.STAGE_HOST_MEMORY = args.stage_host
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no GPU here", file=sys.stderr)
        raise SystemExit(0)
    timers = Timers()
    instrument(timers)
    cases = [c for c in args.cases.split(",") if c]
    largest = max(sum(os.path.getsize(f) for f in data_files(os.path.join(args.dir, n))) for n in os.listdir(args.dir))
    host = torch.empty(largest, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev_buf = torch.empty(largest, dtype=torch.uint8, device=device) if device.type != "cpu" else host
    raw_threads = len(os.sched_getaffinity(0))
    rows = []
    for cell in args.grid.split(","):
        threads_s, stage_s, *flags = cell.split(":")
        threads, stage_mib = int(threads_s), int(stage_s)
        verify(on="nv" not in flags)
        mapped_copy(on="mc" in flags)
        variants(flags)
        mapped = [int(f[1:]) for f in flags if f[:1] == "m" and f[1:].isdigit()]
        options = LoadOptions(fill_threads=threads, stage_bytes=stage_mib << 20)
        if mapped:
            options = dataclasses.replace(options, mapped_bytes=mapped[0] << 20)
        for case in cases:
            source, target, rank = CASES[case]
            src = os.path.join(args.dir, layout_name(source))
            reader = CheckpointReader(src)
            (rank_plan,) = plan_load(reader.index, target, [rank]).ranks
            tensors = reader.index.tensors
            out = {
                (p.tensor, p.box): torch.empty(
                    p.box.shape, dtype=dtypes.to_torch(tensors[p.tensor].dtype), device=device
                )
                for p in rank_plan.pieces
            }
            needed = sum(t.numel() * t.element_size() for t in out.values())
            files = data_files(src)
            for rep in range(args.reps):
                sync(device)
                t0 = time.perf_counter()
                raw_read(files, host, dev_buf, raw_threads, limit=None if target.world == 1 else needed)
                sync(device)
                raw_s = time.perf_counter() - t0
                timers.reset()
                stats = LoadStats()
                t0 = time.perf_counter()
                load_rank_state(src, target, rank, device=device, out=out, stats=stats, options=options)
                sync(device)
                wall = time.perf_counter() - t0
                phases = timers.reset()
                row = {
                    "threads": threads,
                    "stage_mib": stage_mib,
                    "verified": "nv" not in flags,
                    "mapped_copy": "mc" in flags,
                    "mapped_mib": options.mapped_bytes >> 20,
                    "flags": flags,
                    "case": case,
                    "rep": rep,
                    "load_s": round(wall, 4),
                    "raw_s": round(raw_s, 4),
                    "over_raw": round(raw_s / wall, 3),
                    "needed_gb": round(needed / 1e9, 3),
                    "read_gb": round(stats.bytes_read / 1e9, 3),
                    **phases,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
            del out
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "load_gpu_phases.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": rows, "cores": raw_threads}, f, indent=1)


if __name__ == "__main__":
    main()
