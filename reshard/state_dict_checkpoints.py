"""Checkpoints of state dicts (no bundled model): what an offline reshard writes them as.

A checkpoint saved by ``moeckpt.save``, ``dcp.save`` through ``moeckpt.dcp`` or ``import-dcp --mapping none``
describes each tensor by a device mesh or by the pieces its files list, not by tensor- or expert-parallel rules:
nothing says which dimension a tensor-parallel split would cut. Resharding it offline therefore takes the target
as a device mesh of writers and one placement per mesh dimension, applied to every tensor (:class:`WriterMesh`):
``--dp N`` alone is the one-dimensional mesh of N writers with every tensor split along dim 0 (FSDP's layout);
``--mesh 2x2 --placements 'S(0),S(1)'`` is an FSDP x TP grid, each writer's file holding the box that rank of such
a run holds. A placement naming a dimension a tensor lacks (``S(1)`` of a bias, any ``S`` of a 0-d tensor) is
``R`` for that tensor, and replicated boxes are written once. Loading into any other mesh is ``moeckpt.load``'s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import STORED_SHARDING, Index, MeshEntry

from .layout import Layout
from .mesh import MeshPlacement

__all__ = ["GENERIC_ARCH", "WriterMesh", "is_state_dict", "sharded_over_writers"]

#: the model of a checkpoint that holds a state dict of no bundled architecture.
GENERIC_ARCH = "generic"
#: the most writers a target mesh may have (the CLI's largest degree).
MAX_WRITERS = 4096


def is_state_dict(index: Index) -> bool:
    """Whether ``index`` holds a state dict (generic model, or tensors sharded by meshes or stored pieces)."""
    return (
        index.model.get("arch") == GENERIC_ARCH
        or bool(index.meshes)
        or any(e.sharding == STORED_SHARDING for e in index.tensors.values())
    )


@dataclass(frozen=True)
class WriterMesh:
    """The target of a state-dict reshard: a mesh of writers (row-major ranks 0..n-1) and the placement of every
    tensor on each of its dimensions (``R``, ``S(d)``; ``S(d)`` is ``R`` for a tensor without dim ``d``)."""

    shape: tuple[int, ...]
    placements: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.shape or any(n < 1 for n in self.shape) or math.prod(self.shape) > MAX_WRITERS:
            raise LayoutError(f"mesh {self.text}: give 1 to {MAX_WRITERS} writers as positive sizes, e.g. 2x2")
        if len(self.placements) != len(self.shape):
            raise LayoutError(
                f"mesh {self.text} has {len(self.shape)} dimensions but {len(self.placements)} placements "
                f"({','.join(self.placements)}) were given; give one per mesh dimension, e.g. 'S(0),S(1)'"
            )
        for p in self.placements:
            placement = MeshPlacement.from_json(p, f"placement {p!r}")
            if placement.kind == "SS":
                raise LayoutError(f"placement {p}: a reshard target takes R or S(dim) only")

    @property
    def text(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def writers(self) -> int:
        return math.prod(self.shape)

    @staticmethod
    def parse_shape(mesh: str) -> tuple[int, ...]:
        """``"2x2"`` as ``(2, 2)``: positive sizes joined by ``x``, 1 to 4096 writers in all."""
        text = mesh.strip()
        shape = tuple(int(n) for n in text.split("x")) if re.fullmatch(r"\d{1,4}(x\d{1,4}){0,7}", text) else ()
        if not shape or min(shape) < 1 or math.prod(shape) > MAX_WRITERS:
            raise LayoutError(
                f"{mesh!r} is not a mesh shape such as 4 or 2x2 (positive sizes joined by 'x', 1 to "
                f"{MAX_WRITERS} writers)"
            )
        return shape

    @classmethod
    def parse(cls, mesh: str, placements: str | None = None) -> WriterMesh:
        """``"2x2"`` and ``"S(0),S(1)"`` (default: ``S(0)`` on every mesh dimension)."""
        shape = cls.parse_shape(mesh)
        given = (
            tuple(p.strip() for p in re.split(r",(?![^(]*\))", placements)) if placements else ("S(0)",) * len(shape)
        )
        return cls(shape, given)

    @classmethod
    def over(cls, dp: int) -> WriterMesh:
        """``dp`` writers, every tensor split along dim 0 (what ``--dp N`` means for a state dict)."""
        return cls((dp,), ("S(0)",))

    def for_tensor(self, ndim: int) -> list[str]:
        """The placements of a tensor of rank ``ndim``: an ``S(d)`` it has no dim ``d`` for is ``R``."""
        return [p if p == "R" or MeshPlacement.from_json(p).dim < ndim else "R" for p in self.placements]


def sharded_over_writers(index: Index, target: Layout, mesh: WriterMesh | None = None) -> Index:
    """``index`` with every tensor placed on ``mesh`` (default: split along dim 0 over ``target.dp`` writers,
    FSDP's layout), for an offline reshard of a state-dict checkpoint; ``target`` must have tp = ep = 1 and
    as many writers (``dp``) as the mesh."""
    if target.tp != 1 or target.ep != 1:
        raise LayoutError(
            f"{target}: a state-dict checkpoint has no tensor- or expert-parallel rules (its tensors were saved by "
            "meshes, not by a bundled model's plan); reshard it with --dp N or --mesh SHAPE --placements P,..., "
            "or load it into any mesh with moeckpt.load"
        )
    mesh = mesh or WriterMesh.over(target.dp)
    if mesh.writers != target.dp:
        raise LayoutError(f"mesh {mesh.text} has {mesh.writers} writers but the target layout has dp={target.dp}")
    entry = MeshEntry(mesh.shape, tuple(range(mesh.writers)))
    tensors = {
        name: replace(e, sharding={"mesh": 0, "placements": mesh.for_tensor(len(e.shape))}, mesh=entry)
        for name, e in index.tensors.items()
    }
    return replace(index, tensors=tensors, meshes=(entry,), layout={})
