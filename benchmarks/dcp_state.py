"""The peer in the benchmarks: moeckpt's logical tensors as DTensors for torch DCP, sharded as our layout shards them.

DTensor cannot express the block-wise TP split of fused tensors, so those are split contiguously; the bytes each
rank holds are the same.
"""

from __future__ import annotations

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import ZERO_ROLES
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import rule_of


def dcp_state(tensors: dict[str, TensorEntry], layout: Layout, generator: torch.Generator | None):
    """Every logical tensor as a DTensor on an (edp, ep, tp) mesh (rank order matches ``Layout.coords``).

    Local shards are random from ``generator``, or zeros when it is ``None`` (a load target).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (layout.edp, layout.ep, layout.tp), mesh_dim_names=("edp", "ep", "tp"))
    out = {}
    for entry in tensors.values():
        rule = rule_of(entry)
        zero = entry.role in ZERO_ROLES and len(entry.shape) > 0
        tp = Shard(rule.tp.dim) if rule.tp is not None else Replicate()
        if rule.expert_dim is not None:
            place = [Shard(0) if zero else Replicate(), Shard(rule.expert_dim), tp]
        else:
            place = [Shard(0) if zero else Replicate(), Shard(0) if zero else Replicate(), tp]
        shape, _ = compute_local_shape_and_global_offset(entry.shape, mesh, place)
        dtype = dtypes.to_torch(entry.dtype)
        if generator is None:
            # Zeroed, not left unwritten: a trainer's load target is an initialised model, and a first write to
            # fresh pages (a page fault per page, slow in a virtual machine) would be timed as the load's.
            local = torch.zeros(shape, dtype=dtype)
        else:
            local = torch.randn(shape, generator=generator).to(dtype)
        stride = torch.empty(entry.shape, device="meta").stride()
        out[entry.name] = DTensor.from_local(
            local, mesh, place, run_check=False, shape=torch.Size(entry.shape), stride=stride
        )
    return out
