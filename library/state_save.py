"""From the state dicts of the ranks of a group to one checkpoint: agree on its tensors, then each rank writes its
share.

Every rank flattens its state dict (:mod:`moeckpt.library.state_dict`) and describes each leaf: a DTensor's global
shape, dtype, mesh and placements; a plain tensor's shape and dtype; a JSON value itself. The ranks gather the
distinct descriptions (ranks that hold the same keys alike, as the data-parallel replicas do, send theirs once)
and merge them into the union: a key held by several ranks must agree in everything but its data, else one error
on every rank. Each tensor becomes an index entry with a mesh sharding: a DTensor's own mesh and placements, a
plain tensor replicated over a one-dimensional mesh of the ranks holding it. Replicated boxes are written once,
the writer rotating over the holders; every rank then writes the boxes it is the writer of, as views of its local
tensors (:func:`rank_pieces`), and :func:`~moeckpt.reshard.save_protocol.save_collective` commits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash

from moeckpt.formats.box import Box
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import MoeckptError, StateDictError
from moeckpt.formats.index import Index, MeshEntry, TensorEntry
from moeckpt.reshard import collectives
from moeckpt.reshard.mesh import MeshGeometry, MeshPlacement, local_boxes, mesh_geometry, name_seed

from .state_dict import Leaf, flatten, leaf_of

__all__ = ["SavePlan", "plan_state_save", "rank_pieces"]

#: the ``model`` of a checkpoint that holds a state dict of no bundled architecture.
GENERIC_MODEL: dict[str, Any] = {"arch": "generic", "config": {}}


#: ``(key, box, index into the local tensor)`` of each box a rank writes (``None``: the whole local tensor).
Selection = tuple[tuple[str, Box, tuple[slice, ...] | None], ...]


@dataclass(frozen=True)
class SavePlan:
    """The agreed checkpoint of a group's state dicts, and this rank's leaves."""

    index: Index
    #: every stored box of every tensor (for the backend's prepare).
    boxes: dict[str, list[Box]]
    #: this rank's tensor leaves by key.
    leaves: dict[str, Leaf]
    rank: int
    #: the boxes this rank writes, in key order.
    selection: Selection = ()


def group_rank_of(group):
    """A function mapping a global rank to its rank in ``group`` (identity without torch.distributed)."""
    if not collectives.is_distributed():
        return lambda r: r
    import torch.distributed as dist

    if group is None:
        return lambda r: r
    return lambda r: dist.get_group_rank(group, r)


def _gather_descriptions(mine: list, digest: str, digests: list[str], group) -> list[list]:
    """Every rank's description, each distinct one sent once (by the lowest rank that has it)."""
    me = collectives.rank(group)
    first = digests.index(digest) == me
    sent = collectives.all_gather_json(mine if first else None, group)
    by_digest = {digests[g]: d for g, d in enumerate(sent) if d is not None}
    return [by_digest[d] for d in digests]


#: merged tensor plans by (backend, model, every rank's tensor-description digest), with this rank's selection
#: of boxes (:func:`_select`): a trainer saves the same structure every time, so after the first save only the
#: JSON values travel and nothing is merged or selected again.
_PLANS: dict[tuple, tuple[Index, dict[str, list[Box]], Selection]] = {}
_PLANS_KEPT = 4


def plan_state_save(
    state_dict: Mapping[str, Any],
    *,
    group=None,
    backend: str = "safetensors",
    step: int = 0,
    model: dict[str, Any] | None = None,
    compress: str = NONE,
) -> SavePlan:
    """Collective over ``group``: the index of the group's checkpoint (written with the compression setting
    ``compress``) and this rank's leaves."""
    me = collectives.rank(group)
    error: MoeckptError | None = None
    leaves: list[Leaf] = []
    tensors_mine: list = []
    values_mine: list = []
    try:
        to_group = group_rank_of(group)
        with torch.no_grad():  # a DTensor's to_local() is then its local tensor, not a view with an autograd node
            leaves = [leaf_of(k, v, to_group_rank=to_group) for k, (_, v) in flatten(state_dict).items()]
        for leaf in leaves:
            if leaf.kind == "value":
                values_mine.append(leaf.describe() + [leaf.local])
            else:
                tensors_mine.append(leaf.describe())
    except MoeckptError as e:
        error, tensors_mine, values_mine = e, [], []
    except ValueError as e:  # get_group_rank of a rank outside the group, say
        error, tensors_mine, values_mine = StateDictError(str(e)), [], []
    digest = xxhash.xxh3_128_hexdigest(json.dumps(tensors_mine, separators=(",", ":"), allow_nan=True).encode())
    note = None if error is None else [type(error).__name__, str(error)]
    # One exchange carries every rank's error, its tensor digest and its (small) JSON values.
    gathered = collectives.all_gather_json([note, digest, values_mine], group)
    if error is not None:
        raise error
    for g, (other, _, _) in enumerate(gathered):
        if other is not None:
            raise StateDictError(f"rank {g} of the group refused the save: {other[1]}")
    digests = [d for _, d, _ in gathered]
    mine = {leaf.key: leaf for leaf in leaves if leaf.kind != "value"}
    # This rank's position too: the selection is its own (two groups of one structure may place it differently).
    key = (backend, json.dumps(model, sort_keys=True), tuple(digests), me)
    cached = _PLANS.get(key)
    if cached is None:
        everyone = _gather_descriptions(tensors_mine, digest, digests, group)
        try:
            merged, merged_boxes = _merge(everyone, backend=backend, step=0, model=model)
        except MoeckptError as e:  # the same on every rank: each merged the same descriptions
            raise e from None
        cached = (merged, merged_boxes, _select(merged, mine, me))
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = cached
    tensor_index, boxes, selection = cached
    values = _merge_values([v for _, _, v in gathered], tensor_index.tensors)
    index = replace(tensor_index, step=step, train_state=values, compress=compress)
    return SavePlan(index, boxes, mine, me, selection)


def _merge_values(everyone: list[list], tensors: Mapping[str, TensorEntry]) -> dict[str, Any]:
    """The JSON values of every rank: a key held by several ranks must hold the same value, and no key may be a
    value on one rank and a tensor on another."""
    values: dict[str, Any] = {}
    first: dict[str, int] = {}
    for g, desc in enumerate(everyone):
        for item in desc:
            key, value = item[0], item[2]
            if key in tensors:
                raise StateDictError(
                    f"key {key!r} differs between ranks (a tensor on some, a value on rank {g}): a key held by "
                    "several ranks must agree; key per-rank values by rank, e.g. f'loader.rank{rank}'"
                )
            if key in values:
                if values[key] != value:
                    raise StateDictError(
                        f"key {key!r} differs between ranks {first[key]} and {g} (values): a key held by several "
                        "ranks must agree; key per-rank values by rank, e.g. f'loader.rank{rank}'"
                    )
                continue
            values[key], first[key] = value, g
    return dict(sorted(values.items()))


def _merge(everyone: list[list], *, backend: str, step: int, model) -> tuple[Index, dict[str, list[Box]]]:
    # key -> (description without the mesh's ranks, {mesh ranks: ranks holding the key on that mesh})
    seen: dict[str, tuple[list, dict[tuple[int, ...], list[int]]]] = {}
    for g, desc in enumerate(everyone):
        for item in desc:
            key = item[0]
            shape_of = item[:5] + item[6:] if item[1] == "dtensor" else item
            ranks = tuple(item[5]) if item[1] == "dtensor" else ()
            found = seen.get(key)
            if found is None:
                seen[key] = (shape_of, {ranks: [g]})
                continue
            if found[0] != shape_of:
                first = next(iter(found[1].values()))[0]
                what = "values" if item[1] == "value" == found[0][1] else "shape, dtype, mesh or placements"
                raise StateDictError(
                    f"key {key!r} differs between ranks {first} and {g} ({what}): a key held by several ranks "
                    "must agree; key per-rank values by rank, e.g. f'loader.rank{rank}'"
                )
            found[1].setdefault(ranks, []).append(g)
    meshes: list[MeshEntry] = []
    mesh_pos: dict[MeshEntry, int] = {}
    tensors: dict[str, TensorEntry] = {}
    values: dict[str, Any] = {}
    boxes: dict[str, list[Box]] = {}
    made: dict[tuple, tuple[MeshEntry, list[str]]] = {}  # the same mesh for thousands of tensors: built once
    for key in sorted(seen):
        item, by_mesh = seen[key]
        if item[1] == "value":
            values[key] = item[2]
            continue
        sig = (
            item[1],
            tuple(item[4]) if item[1] == "dtensor" else (),
            tuple(item[5]) if item[1] == "dtensor" else (),
            tuple((r, tuple(h)) for r, h in by_mesh.items()),
        )
        made_mesh = made.get(sig)
        if made_mesh is None:
            made_mesh = made[sig] = _mesh_of(key, item, by_mesh)
        mesh, placements = made_mesh
        pos = mesh_pos.setdefault(mesh, len(meshes))
        if pos == len(meshes):
            meshes.append(mesh)
        _, _, shape, dtype = item[:4]
        tensors[key] = TensorEntry(
            name=key,
            shape=tuple(shape),
            dtype=dtype,
            role="param",
            param=key,
            sharding={"mesh": pos, "placements": list(placements)},
            mesh=mesh,
        )
        geo = mesh_geometry(tuple(shape), mesh.shape, _parsed(tuple(placements)))
        boxes[key] = list(geo.boxes)
    index = Index(
        backend=backend,
        step=step,
        layout={},
        model=dict(model or GENERIC_MODEL),
        tensors=tensors,
        files={},
        train_state=values,
        meshes=tuple(meshes),
    )
    return index, boxes


_PARSED: dict[tuple[str, ...], tuple[MeshPlacement, ...]] = {}


def _parsed(placements: tuple[str, ...]) -> tuple[MeshPlacement, ...]:
    found = _PARSED.get(placements)
    if found is None:
        found = _PARSED[placements] = tuple(MeshPlacement.from_json(p) for p in placements)
    return found


def _mesh_of(key: str, item: list, by_mesh: dict[tuple[int, ...], list[int]]) -> tuple[MeshEntry, list[str]]:
    """The mesh and placements a key is stored with.

    A plain tensor: replicated over a one-dimensional mesh of the ranks holding it. A DTensor: its mesh; when the
    same key lives on several disjoint meshes of one shape and placements (FSDP2 + TP: a parameter TP leaves whole
    is FSDP-sharded on the data-parallel sub-mesh of each TP rank), those are replicas of one another, stacked as
    a leading replicated mesh dimension.
    """
    if item[1] == "tensor":
        holders = sorted(g for gs in by_mesh.values() for g in gs)
        return MeshEntry((len(holders),), tuple(holders)), ["R"]
    mesh_shape, placements = item[4], item[5]
    for ranks, holders in by_mesh.items():
        if sorted(ranks) != sorted(holders):
            raise StateDictError(
                f"key {key!r}: its DTensor's mesh spans ranks {sorted(ranks)[:8]} but ranks {sorted(holders)[:8]} "
                "hold it on that mesh; every rank of the mesh must pass the key"
            )
    if len(by_mesh) == 1:
        (ranks,) = by_mesh
        return MeshEntry(tuple(mesh_shape), ranks), list(placements)
    replicas = sorted(by_mesh, key=min)
    flat = [r for ranks in replicas for r in ranks]
    if len(set(flat)) != len(flat):
        raise StateDictError(f"key {key!r} lives on overlapping meshes {replicas[:2]}; it must be one DTensor's")
    return MeshEntry((len(replicas), *mesh_shape), tuple(flat)), ["R", *placements]


def rank_pieces(plan: SavePlan) -> list[tuple[str, Box, torch.Tensor]]:
    """``(key, box, view of the local tensor)`` of every box this rank writes."""
    out = []
    for key, box, index in plan.selection:
        local = plan.leaves[key].local.detach()
        out.append((key, box, local if index is None else local[index]))
    return out


def _select(index: Index, leaves: Mapping[str, Leaf], rank: int) -> Selection:
    """The boxes ``rank`` writes (:attr:`SavePlan.selection`), in key order whatever the state dict's order, so a
    file's bytes are determined."""
    out: list[tuple[str, Box, tuple[slice, ...] | None]] = []
    # Tensors of one structure (shape, mesh, placements) share their geometry and this rank's boxes: computed once.
    local: dict[tuple, tuple[MeshGeometry, dict[Box, tuple[int, ...]]]] = {}
    for key in sorted(leaves):
        entry = index.tensors[key]
        mesh = entry.mesh
        if mesh is None:  # unreachable: _merge gives every tensor of a state-dict checkpoint a mesh
            raise StateDictError(f"tensor {key!r} has no mesh sharding")
        placements = _parsed(tuple(entry.sharding["placements"]))
        sig = (entry.shape, mesh, placements)
        found = local.get(sig)
        if found is None:
            geo = mesh_geometry(entry.shape, mesh.shape, placements)
            coord = _coord(mesh.ranks.index(rank), mesh.shape)
            found = local[sig] = (geo, dict(local_boxes(entry.shape, mesh.shape, coord, placements)))
        geo, offsets_of = found
        seed = name_seed(key)
        whole = tuple(leaves[key].local.shape)
        for i, box in enumerate(geo.boxes):
            if geo.writer(i, mesh.ranks, seed) != rank or box not in offsets_of:
                continue
            offsets = offsets_of[box]
            if not box.ndim or (box.shape == whole and not any(offsets)):
                out.append((key, box, None))
            else:
                out.append((key, box, tuple(slice(o, o + s) for o, s in zip(offsets, box.shape))))
    return tuple(out)


def _coord(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for n in reversed(shape):
        flat, r = divmod(flat, n)
        out.append(r)
    return list(reversed(out))
