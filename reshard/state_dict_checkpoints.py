"""Checkpoints of state dicts (no bundled model): what an offline reshard writes them as.

A checkpoint saved by ``moeckpt.save``, ``dcp.save`` through ``moeckpt.dcp`` or ``import-dcp --mapping none``
describes each tensor by a device mesh or by the pieces its files list, not by tensor- or expert-parallel rules:
nothing says which dimension a tensor-parallel split would cut. Resharding it offline therefore changes only how
many files hold it: ``dp`` writers, every tensor split along dim 0 over a one-dimensional mesh of them (FSDP's
layout; a 0-d tensor is replicated, so written once). Loading into any other mesh is ``moeckpt.load``'s job.
"""

from __future__ import annotations

from dataclasses import replace

from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import STORED_SHARDING, Index, MeshEntry

from .layout import Layout

__all__ = ["GENERIC_ARCH", "is_state_dict", "sharded_over_writers"]

#: the model of a checkpoint that holds a state dict of no bundled architecture.
GENERIC_ARCH = "generic"


def is_state_dict(index: Index) -> bool:
    """Whether ``index`` holds a state dict (generic model, or tensors sharded by meshes or stored pieces)."""
    return (
        index.model.get("arch") == GENERIC_ARCH
        or bool(index.meshes)
        or any(e.sharding == STORED_SHARDING for e in index.tensors.values())
    )


def sharded_over_writers(index: Index, target: Layout) -> Index:
    """``index`` with every tensor split along dim 0 over ``target.dp`` writers (FSDP's layout), for an offline
    reshard of a state-dict checkpoint; ``target`` must have tp = ep = 1."""
    if target.tp != 1 or target.ep != 1:
        raise LayoutError(
            f"{target}: a state-dict checkpoint has no tensor- or expert-parallel rules (its tensors were saved by "
            "meshes, not by a bundled model's plan); reshard it with --dp N only, or load it into any mesh with "
            "moeckpt.load"
        )
    mesh = MeshEntry((target.dp,), tuple(range(target.dp)))
    tensors = {
        name: replace(e, sharding={"mesh": 0, "placements": ["S(0)" if e.shape else "R"]}, mesh=mesh)
        for name, e in index.tensors.items()
    }
    return replace(index, tensors=tensors, meshes=(mesh,), layout={})
