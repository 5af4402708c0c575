"""Storage benchmark: save and load in both formats, on local disk and on S3 (moto), against raw I/O, in one run.

The state: ``--gb`` of sharded training state in a ZeRO-1 layout over ``--writers`` ranks (large fp32 ``master``
tensors split along dim 0, plus small replicated bf16 parameters written once), held in memory before timing.
For each storage (a local directory and an ``s3://`` bucket on a moto server running in its own process, reached
through s3fs over HTTP) and each method:

* ``safetensors`` / ``zarr``: ``save_pieces`` (the writers' pieces written by ``--writers`` threads, data fsynced
  on local disk, index last), then a load in which ``--writers`` threads each read their own boxes back through
  ``CheckpointReader.read_box`` (checksums verified);
* ``raw``: the same bytes, one file per writer, written through the same filesystem (local: ``open().write`` +
  ``os.fsync``; S3: one s3fs ``pipe_file`` per writer, multipart with concurrent parts) and read back whole (local
  ``readinto``; S3 ``cat_file``) by ``--writers`` threads.

Each repetition rotates the method order; the best time of each is reported (all are kept in the JSON).
Local reads are made cold by dropping the written files from the page cache (``posix_fadvise(DONTNEED)`` per
file, which touches no other process's cache). Results (GB/s of payload bytes, ratio to raw) go to
``docs/benchmarks/storage.json`` and ``storage.png``.

    python benchmarks/bench_storage.py --gb 1.07     # the full run (once; the machine is shared)
    python benchmarks/bench_storage.py --gb 0.05     # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from moeckpt.formats.checkpoint import CheckpointReader, save_pieces
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.formats.pieces import Piece, tensor_bytes
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import placements, rank_boxes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.s3_fixtures import MotoServer, make_bucket  # noqa: E402  (the repository's tests/, on sys.path from here)

METHODS = ("raw", "safetensors", "zarr")
BUCKET = "moeckpt-bench"


# -- the state -------------------------------------------------------------------------------------------------
def build_state(gb: float, writers: int) -> tuple[dict[str, TensorEntry], dict[int, list[Piece]], Layout]:
    """Tensors of about ``gb`` GB in a dp=``writers`` ZeRO-1 layout, and every writer's pieces (in memory)."""
    layout = Layout(dp=writers)
    cols = 4096
    big = 64 * 2**20  # bytes of one large fp32 tensor at full size
    total = int(gb * 1e9)
    n_big = max(1, round(total / big))
    rows = max(writers, (total // n_big) // (cols * 4) // writers * writers)
    tensors: dict[str, TensorEntry] = {}
    for i in range(n_big):
        name = f"master/layers.{i}.mlp.weight"
        tensors[name] = TensorEntry(
            name=name, shape=(rows, cols), dtype="float32", role="master", param=f"layers.{i}.mlp.weight"
        )
    for i in range(2 * n_big):  # small replicated tensors (norms): many small objects, as in a real model
        name = f"layers.{i}.norm.weight"
        tensors[name] = TensorEntry(name=name, shape=(cols,), dtype="bfloat16", role="param", param=name)
    gen = torch.Generator().manual_seed(0)
    by_writer: dict[int, list[Piece]] = {w: [] for w in range(writers)}
    for entry in tensors.values():
        full = torch.randn(entry.shape, generator=gen, dtype=torch.float32).to(
            torch.bfloat16 if entry.dtype == "bfloat16" else torch.float32
        )
        for p in placements(entry, layout):
            by_writer[p.writer].append(Piece(entry.name, p.box, full[p.box.slices()].clone()))
    return tensors, by_writer, layout


def payload_bytes(by_writer: dict[int, list[Piece]]) -> int:
    return sum(p.data.numel() * p.data.element_size() for ps in by_writer.values() for p in ps)


# -- storages --------------------------------------------------------------------------------------------------
def start_moto() -> tuple[MotoServer, str]:
    """moto's S3 server in a process of its own (so that it does not share our interpreter's GIL), started as the
    tests start it (tests/s3_fixtures.py), with the bucket made and this process's AWS settings pointed at it."""
    server = MotoServer()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL_S3": server.endpoint,
        }
    )
    make_bucket(server.endpoint, BUCKET)
    return server, server.endpoint


def drop_from_page_cache(root: str) -> None:
    """Evict the files under ``root`` from the page cache, so that the next read comes from the disk."""
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- the methods -----------------------------------------------------------------------------------------------
def raw_save(location: str, blobs: dict[int, list[memoryview]], joined: dict[int, bytes]) -> None:
    s = open_storage(location)

    def one(w: int) -> None:
        if s.is_local:
            os.makedirs(s.location, exist_ok=True)
            with open(s.path(f"raw-{w}.bin"), "wb") as f:
                for b in blobs[w]:
                    f.write(b)
                f.flush()
                os.fsync(f.fileno())
        else:
            s.fs.pipe_file(s._fspath(f"raw-{w}.bin"), joined[w])

    with ThreadPoolExecutor(len(blobs)) as pool:
        list(pool.map(one, sorted(blobs)))


def raw_load(location: str, writers: int, sizes: dict[int, int]) -> int:
    s = open_storage(location)

    def one(w: int) -> int:
        if s.is_local:
            buf = bytearray(sizes[w])
            with open(s.path(f"raw-{w}.bin"), "rb", buffering=0) as f:
                n = 0
                view = memoryview(buf)
                while n < len(buf):
                    got = f.readinto(view[n:])
                    if not got:
                        break
                    n += got
            return n
        return len(s.fs.cat_file(s._fspath(f"raw-{w}.bin")))

    with ThreadPoolExecutor(writers) as pool:
        return sum(pool.map(one, range(writers)))


def format_save(location: str, fmt: str, tensors, by_writer, layout: Layout) -> None:
    index = Index(backend=fmt, step=1, layout=layout.to_json(), model={"arch": "bench"}, tensors=tensors, files={})
    save_pieces(location, index, by_writer, workers=len(by_writer))


def format_load(location: str, tensors, layout: Layout) -> int:
    reader = CheckpointReader(location)
    refs = reader.pieces()
    by_tensor: dict[str, list] = {}
    for r in refs:
        by_tensor.setdefault(r.tensor, []).append(r)

    def one(rank: int) -> int:
        n = 0
        for name, entry in tensors.items():
            if entry.role != "master" and rank != 0:
                continue  # a replicated tensor: one reader is enough for the byte count to match the save
            for box in rank_boxes(entry, layout, rank):
                t = reader.read_box(name, box, by_tensor[name])
                n += t.numel() * t.element_size()
        return n

    with ThreadPoolExecutor(layout.world) as pool:
        return sum(pool.map(one, range(layout.world)))


# -- the run ---------------------------------------------------------------------------------------------------
def clear(location: str) -> None:
    open_storage(location).remove()


def measure(storage, method, local_root, blobs, joined, sizes, tensors, by_writer, layout, nbytes, writers):
    """Seconds to save and to load with one method on one storage (the output is removed afterwards)."""
    base = os.path.join(local_root, method) if storage == "local" else f"s3://{BUCKET}/{method}"
    clear(base)
    t0 = time.perf_counter()
    if method == "raw":
        raw_save(base, blobs, joined)
    else:
        format_save(base, method, tensors, by_writer, layout)
    t_save = time.perf_counter() - t0
    if storage == "local":
        drop_from_page_cache(base)
    t0 = time.perf_counter()
    got = raw_load(base, writers, sizes) if method == "raw" else format_load(base, tensors, layout)
    t_load = time.perf_counter() - t0
    if got != nbytes:
        raise SystemExit(f"{storage}/{method}: loaded {got} bytes, saved {nbytes}")
    clear(base)
    return t_save, t_load


def run(args) -> dict:
    tensors, by_writer, layout = build_state(args.gb, args.writers)
    nbytes = payload_bytes(by_writer)
    blobs = {w: [tensor_bytes(p.data) for p in ps] for w, ps in by_writer.items()}
    joined = {w: b"".join(bs) for w, bs in blobs.items()}
    sizes = {w: len(j) for w, j in joined.items()}
    print(f"state: {len(tensors)} tensors, {nbytes / 1e9:.3f} GB, {args.writers} writers", flush=True)
    moto, endpoint = start_moto()
    local_root = tempfile.mkdtemp(prefix="moeckpt-bench-", dir=args.dir)
    results: dict = {}
    times: dict = {}
    try:
        for rep in range(args.reps):
            for storage in args.storages:
                order = METHODS[rep % len(METHODS) :] + METHODS[: rep % len(METHODS)]  # rotate: no method always first
                for method in order:
                    t_save, t_load = measure(
                        storage,
                        method,
                        local_root,
                        blobs,
                        joined,
                        sizes,
                        tensors,
                        by_writer,
                        layout,
                        nbytes,
                        args.writers,
                    )
                    times.setdefault(storage, {}).setdefault(method, []).append((t_save, t_load))
                    print(
                        f"rep {rep} {storage:6s} {method:12s} save {t_save:7.2f} s ({nbytes / t_save / 1e9:6.3f} GB/s)"
                        f"   load {t_load:7.2f} s ({nbytes / t_load / 1e9:6.3f} GB/s)",
                        flush=True,
                    )
        for storage, by_method in times.items():
            for method, runs in by_method.items():
                t_save, t_load = min(r[0] for r in runs), min(r[1] for r in runs)
                results.setdefault(storage, {})[method] = {
                    "save_s": round(t_save, 3),
                    "load_s": round(t_load, 3),
                    "save_GBps": round(nbytes / t_save / 1e9, 3),
                    "load_GBps": round(nbytes / t_load / 1e9, 3),
                    "all_save_s": [round(r[0], 3) for r in runs],
                    "all_load_s": [round(r[1], 3) for r in runs],
                }
            raw = results[storage]["raw"]
            for method in METHODS[1:]:
                r = results[storage][method]
                r["save_vs_raw"] = round(raw["save_s"] / r["save_s"], 3)
                r["load_vs_raw"] = round(raw["load_s"] / r["load_s"], 3)
    finally:
        moto.stop()
        shutil.rmtree(local_root, ignore_errors=True)
    return {
        "benchmark": "storage: save and load, safetensors and zarr, local disk and S3 (moto), vs raw I/O",
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "reported": f"best of {args.reps} repetitions (method order rotated each repetition)",
        "state": {
            "gb": round(nbytes / 1e9, 3),
            "tensors": len(tensors),
            "writers": args.writers,
            "objects_zarr_note": "one object per piece (grid cell) plus one zarr.json per tensor/group",
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "results": results,
    }


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    storages = list(doc["results"])
    fig, axes = plt.subplots(1, len(storages), figsize=(5 * len(storages), 3.8), squeeze=False)
    for ax, storage in zip(axes[0], storages):
        res = doc["results"][storage]
        xs = range(len(METHODS))
        ax.bar([x - 0.2 for x in xs], [res[m]["save_GBps"] for m in METHODS], 0.4, label="save")
        ax.bar([x + 0.2 for x in xs], [res[m]["load_GBps"] for m in METHODS], 0.4, label="load")
        ax.set_xticks(list(xs), METHODS)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{storage} ({doc['state']['gb']} GB, {doc['state']['writers']} writers)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gb", type=float, default=1.07, help="size of the state in GB")
    ap.add_argument("--writers", type=int, default=4, help="writers (and loading readers)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions (method order rotated); the best is reported")
    ap.add_argument("--storages", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    ap.add_argument("--dir", default=None, help="parent directory of the local checkpoints (default: system temp)")
    ap.add_argument(
        "--out",
        default=os.path.join(REPO, "docs", "benchmarks", "storage"),
        help="output path without extension (.json and .png are written)",
    )
    args = ap.parse_args()
    doc = run(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    plot(doc, args.out + ".png")
    print(f"wrote {args.out}.json and .png")


if __name__ == "__main__":
    main()
