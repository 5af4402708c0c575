"""Worker functions of the format-spec tests: state dicts of DTensors saved on a mesh by each writer (run in fresh
gloo processes by run_local_world)."""

from __future__ import annotations

import math

import torch


def _placements(spec: list[str]):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec:
        if p == "R":
            out.append(Replicate())
        elif p.startswith("SS"):
            d, f = p[3:-1].split(",")
            out.append(_StridedShard(int(d), split_factor=int(f)))
        else:
            out.append(Shard(int(p[2:-1])))
    return out


def full_value(key: str, shape: list[int], dtype: str) -> torch.Tensor:
    """A distinct value per key: arange offset by the key's length (the same on every rank)."""
    n = math.prod(shape)
    t = (torch.arange(n, dtype=torch.float32) + 1000 * len(key)).reshape(shape)
    return t.to(getattr(torch, dtype))


def save_state(rank: int, path: str, mesh_shape, specs: dict, writer: str, fmt: str) -> None:
    """Save ``specs`` ({key: (shape, dtype, placements)}) as DTensors on a mesh of ``mesh_shape``, plus a plain tensor
    and JSON values, through ``writer``: ``"save"`` (moeckpt.save) or ``"dcp"`` (dcp.save + moeckpt.dcp)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import moeckpt
    import moeckpt.dcp

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    sd: dict = {
        "model": {
            k: distribute_tensor(full_value(k, s, d), mesh, _placements(p), src_data_rank=None)
            for k, (s, d, p) in specs.items()
        },
        "plain": full_value("plain", [3, 2], "float32"),
        "step": 7,
    }
    if writer == "save":
        moeckpt.save(sd, path, format=fmt, step=7)
    else:
        dcp.save(sd, storage_writer=moeckpt.dcp.StorageWriter(path, format=fmt, step=7))


def save_each_way(rank: int, root: str, mesh_shape, specs: dict, with_dcp: bool) -> None:
    """:func:`save_state` with ``moeckpt.save`` on both backends (``root/save-<format>``), and through
    ``dcp.save`` (``root/dcp-<format>``) when ``with_dcp`` (DCP plans no strided shard but FSDP2 + TP's)."""
    import os

    for writer in ("save", "dcp") if with_dcp else ("save",):
        for fmt in ("safetensors", "zarr"):
            save_state(rank, os.path.join(root, f"{writer}-{fmt}"), mesh_shape, specs, writer, fmt)


def save_golden_v2_state(rank: int, path: str, fmt: str) -> None:
    """The state of tests/golden/v2 as four ranks of a 2 x 2 mesh hold it, saved with ``moeckpt.save``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import moeckpt

    mesh = init_device_mesh("cpu", (2, 2))
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = torch.arange(4, dtype=torch.bfloat16) + 100
    sd = {
        "model": {
            "w": distribute_tensor(w, mesh, _placements(["SS(0,2)", "S(0)"]), src_data_rank=None),
            "b": distribute_tensor(b, mesh, _placements(["S(0)", "R"]), src_data_rank=None),
        },
        "optim": {"state": {"w": {"step": torch.tensor(3.0)}}},
        "step": 3,
    }
    moeckpt.save(sd, path, step=3, format=fmt)
