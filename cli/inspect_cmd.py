"""``moeckpt inspect``: what a checkpoint holds (layout, step, tensors, sizes, files)."""

from __future__ import annotations

import json
from collections import Counter

import click

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.compression import NONE
from moeckpt.formats.index import STORED_SHARDING

from .params import Text


def stored_sizes(reader: CheckpointReader) -> tuple[int, int]:
    """``(bytes, objects)`` the checkpoint occupies on its storage, its index ``moeckpt.json`` left out.

    Asked of the backend: safetensors' data files are what the index records; zarr adds the chunk/shard objects
    of its arrays from one listing of the storage (no data read).
    """
    objects = reader.backend.stored_objects(reader.storage, reader.index)
    return sum(objects.values()), len(objects)


def summary(reader: CheckpointReader) -> dict:
    """A JSON-able description of a checkpoint, read from its index (plus, for zarr, one listing of its objects)."""
    idx = reader.index
    roles = Counter(t.role for t in idx.tensors.values())
    role_bytes: Counter = Counter()
    for t in idx.tensors.values():
        role_bytes[t.role] += t.nbytes
    stored_bytes, stored_objects = stored_sizes(reader)
    return {
        "location": reader.location,
        "format_version": idx.format_version,
        "backend": idx.backend,
        "compress": idx.compress,
        "step": idx.step,
        "layout": idx.layout,
        "meshes": [m.to_json() for m in idx.meshes],
        "shardings": shardings(idx),
        "model": idx.model,
        "train_state": idx.train_state,
        "num_tensors": len(idx.tensors),
        "logical_bytes": idx.nbytes,
        "stored_bytes": stored_bytes,
        "stored_objects": stored_objects,
        "roles": {r: {"tensors": roles[r], "bytes": role_bytes[r]} for r in sorted(roles)},
        "tensors": {
            n: {"shape": list(t.shape), "dtype": t.dtype, "role": t.role, "sharding": t.sharding}
            for n, t in sorted(idx.tensors.items())
        },
        "files": {p: {"size": f.size, "checksum": f.checksum} for p, f in sorted(idx.files.items())},
    }


def shardings(idx) -> dict[str, int]:
    """How many tensors are sharded each way: by the layout's rules, over mesh ``i``, as stored, or replicated."""
    counts: Counter = Counter()
    for t in idx.tensors.values():
        if t.sharding == STORED_SHARDING:
            counts["stored pieces"] += 1
        elif "mesh" in t.sharding:
            counts[f"mesh {t.sharding['mesh']}"] += 1
        elif t.sharding:
            counts["layout rules"] += 1
        else:
            counts["replicated"] += 1
    return dict(sorted(counts.items()))


def _layout_line(info: dict) -> str:
    """The layout (tp, ep, dp) of a trainer's checkpoint; for a state-dict checkpoint, its meshes and shardings."""
    if info["layout"]:
        return " ".join(f"{k}={v}" for k, v in info["layout"].items())
    parts = [
        f"mesh {i} {'x'.join(map(str, m['shape']))} over {len(m['ranks'])} ranks" for i, m in enumerate(info["meshes"])
    ]
    counts = ", ".join(f"{what}: {n}" for what, n in info["shardings"].items())
    return (
        "none (a state-dict checkpoint)"
        + (f"; {'; '.join(parts)}" if parts else "")
        + f"; tensors by sharding: {counts}"
    )


#: data files listed by name before the rest is summarised.
MAX_LISTED = 16


def _mb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB"


@click.command("inspect")
@click.argument("ckpt", type=Text())
@click.option("--json", "as_json", is_flag=True, help="print the full description as JSON (every tensor and file)")
def command(ckpt: str, as_json: bool) -> None:
    """Describe CKPT (a checkpoint, or a run directory: its newest committed step)."""
    reader = CheckpointReader(ckpt)
    info = summary(reader)
    if as_json:
        click.echo(json.dumps(info, indent=1))
        return
    layout = _layout_line(info)
    click.echo(f"checkpoint  {info['location']}")
    compressed = f", compressed {info['compress']}" if info["compress"] != NONE else ""
    click.echo(f"format      moeckpt v{info['format_version']} ({info['backend']}{compressed})")
    click.echo(f"model       {info['model'].get('arch')}")
    click.echo(f"step        {info['step']}")
    click.echo(f"layout      {layout}")
    click.echo(
        f"tensors     {info['num_tensors']} ({_mb(info['logical_bytes'])} logical, {_mb(info['stored_bytes'])} stored)"
    )
    for role, r in info["roles"].items():
        click.echo(f"  {role:<11} {r['tensors']:>6} tensors  {_mb(r['bytes']):>14}")
    chunks = info["stored_objects"] - len(info["files"])
    files_summary = reader.backend.files_summary
    if files_summary is not None:  # the index lists metadata documents; the data are objects it does not list
        meta = sum(f["size"] for f in info["files"].values())
        line = files_summary.format(
            files=len(info["files"]), meta=_mb(meta), chunks=chunks, data=_mb(info["stored_bytes"] - meta)
        )
        click.echo(f"files       {line}; --json lists them")
        return
    extra = f" (+ {chunks} chunk objects, not in the index)" if chunks else ""
    click.echo(f"files       {len(info['files'])}{extra}")
    items = list(info["files"].items())
    for path, f in items[:MAX_LISTED]:
        click.echo(f"  {path:<40} {_mb(f['size']):>14}")
    if len(items) > MAX_LISTED:
        rest = sum(f["size"] for _, f in items[MAX_LISTED:])
        click.echo(f"  ... and {len(items) - MAX_LISTED} more files ({_mb(rest)}); --json lists them")
