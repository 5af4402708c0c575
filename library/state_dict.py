"""State dicts as trainers hold them: flattened keys, and what each leaf is (DTensor, tensor or JSON value).

Keys are flattened exactly as ``torch.distributed.checkpoint`` does (``flatten_state_dict``): nested mappings join
their keys with ``.``; a list is walked (its items get their index as a key part) only when it holds a tensor or
a mapping somewhere, else it is one value; tuples are values. So a key here is the key DCP would use, and a
moeckpt checkpoint and a DCP one of the same state dict name their tensors alike.

Leaves are ``DTensor`` (any mesh, placements ``Replicate``, ``Shard``, torch's ``_StridedShard``), plain
``torch.Tensor`` (the same on every rank holding it), or JSON values (numbers, strings, booleans, ``None``, and
lists/tuples/dicts of them). Anything else is refused with one line naming the key and the type: nothing is
pickled, ever.
"""

from __future__ import annotations

import json
import math
import sys
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.errors import StateDictError
from moeckpt.formats.index import check_tensor_name
from moeckpt.reshard.mesh import MeshPlacement

__all__ = ["Leaf", "StateDictError", "flatten", "leaf_of", "set_flat"]


Path = tuple[Any, ...]


def _terminal(value: Any) -> bool:
    """DCP's rule: a list is walked only if it (recursively) holds a tensor or a mapping; all else is a leaf."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for item in value:
        if isinstance(item, (Mapping, list)) and not _terminal(item):
            return False
        if isinstance(item, torch.Tensor):
            return False
    return True


def _walk(path: Path, value: Any) -> Iterator[tuple[Path, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(path + (str(k),), v)
    elif _terminal(value):
        yield path, value
    else:
        for i, v in enumerate(value):
            yield from _walk(path + (i,), v)


def flatten(state_dict: Mapping[str, Any]) -> dict[str, tuple[Path, Any]]:
    """``{flat key: (path in the nested dict, leaf)}`` in traversal order; refuses keys that flatten alike."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"a state dict must be a mapping of names to values, got {type(state_dict).__name__}")
    out: dict[str, tuple[Path, Any]] = {}
    for key, value in state_dict.items():
        for path, leaf in _walk((str(key),), value):
            flat = ".".join(map(str, path))
            if flat in out:
                raise StateDictError(f"state dict keys {out[flat][0]} and {path} both flatten to {flat!r}; rename one")
            out[flat] = (path, leaf)
    return out


def set_flat(state_dict: MutableMapping[str, Any], path: Path, value: Any) -> None:
    """Put ``value`` at ``path`` of a nested state dict (the caller's, in place), as ``dcp.load`` does for values."""
    node: Any = state_dict
    for part in path[:-1]:
        node = node[part] if isinstance(node, list) else node[_key_in(node, part)]
    last = path[-1]
    if isinstance(node, list):
        node[last] = value
    else:
        node[_key_in(node, last)] = value


def _key_in(node: Mapping, part: Any) -> Any:
    """The mapping's own key whose string form is ``part`` (keys were str()-ed when flattened: int keys too)."""
    if part in node:
        return part
    for k in node:
        if str(k) == part:
            return k
    raise KeyError(part)


@dataclass(frozen=True)
class Leaf:
    """One flattened leaf: a tensor to store (with how it is sharded) or a JSON value."""

    key: str
    #: ``dtensor``, ``tensor`` or ``value``.
    kind: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: DTensor only: the mesh's shape, its ranks (row-major, as given: global or group ranks) and the placements.
    mesh_shape: tuple[int, ...] = ()
    mesh_ranks: tuple[int, ...] = ()
    placements: tuple[MeshPlacement, ...] = ()
    #: the tensor this rank holds (``DTensor.to_local()`` for DTensors), or the JSON value.
    local: Any = None

    def describe(self) -> list:
        """What every rank must agree on about this key, as JSON (the data itself excluded)."""
        if self.kind == "value":
            return [self.key, "value"]
        return [
            self.key,
            self.kind,
            list(self.shape),
            self.dtype,
            list(self.mesh_shape),
            list(self.mesh_ranks),
            [p.to_json() for p in self.placements],
        ]


def _placement_of(p: Any, key: str) -> MeshPlacement:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(p, _StridedShard):
        return MeshPlacement("SS", int(p.dim), int(p.split_factor))
    if isinstance(p, Shard):
        return MeshPlacement("S", int(p.dim))
    if isinstance(p, Replicate):
        return MeshPlacement("R")
    raise StateDictError(
        f"key {key!r}: a DTensor with placement {p} cannot be saved (only Replicate, Shard and FSDP2's strided "
        "Shard); a Partial value must be reduced first, e.g. dtensor.redistribute(placements=[Replicate()])"
    )


#: a mesh's shape and ranks (and a placements tuple's parsed form) are asked for once per tensor of a state dict,
#: thousands of times for the same few meshes: kept by the mesh object (weakly, so a mesh that goes is forgotten).
_MESH_RANKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLACEMENTS: dict[tuple, tuple[MeshPlacement, ...]] = {}


def _mesh_shape_and_ranks(mesh: Any, to_group_rank) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The mesh's shape and its ranks (mapped by ``to_group_rank``)."""
    by_map = _MESH_RANKS.get(mesh)
    if by_map is None:
        by_map = _MESH_RANKS[mesh] = {}
    key = id(to_group_rank) if to_group_rank is not None else None
    found = by_map.get(key)
    if found is None:
        if len(by_map) > 4:  # one rank-mapping function per save: keep only the recent ones
            by_map.clear()
        ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
        if to_group_rank is not None:
            ranks = [to_group_rank(r) for r in ranks]
        found = by_map[key] = (tuple(int(s) for s in mesh.shape), tuple(ranks))
    return found


def _placements_of(placements: tuple, key: str) -> tuple[MeshPlacement, ...]:
    found = _PLACEMENTS.get(placements)
    if found is None:
        found = tuple(_placement_of(p, key) for p in placements)
        if len(_PLACEMENTS) < 10_000:
            _PLACEMENTS[placements] = found
    return found


def _is_dtensor(value: Any) -> bool:
    # No DTensor exists before its module is imported, and importing it costs a fresh process most of a second
    # (the first save of a restarted trainer paid it), so a state without DTensors never imports it.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(value, dtensor)


def leaf_of(key: str, value: Any, *, to_group_rank=None) -> Leaf:
    """Classify one flattened leaf; ``to_group_rank`` maps a DTensor mesh's global ranks to the saving group's."""
    if isinstance(value, torch.Tensor):
        check_tensor_name(key, "state dict")
        try:
            dtype = dtypes.from_torch(value.dtype)
        except ValueError as e:
            raise StateDictError(f"key {key!r}: {e}") from None
        if _is_dtensor(value):
            from torch.distributed.tensor import DTensor

            value = cast(DTensor, value)
            mesh_shape, ranks = _mesh_shape_and_ranks(value.device_mesh, to_group_rank)
            placements = _placements_of(tuple(value.placements), key)
            return Leaf(key, "dtensor", tuple(value.shape), dtype, mesh_shape, ranks, placements, value.to_local())
        if value.is_sparse or value.layout != torch.strided:
            raise StateDictError(f"key {key!r}: a {value.layout} tensor cannot be saved; convert it to a dense tensor")
        return Leaf(key, "tensor", tuple(int(s) for s in value.shape), dtype, local=value)
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        raise StateDictError(
            f"key {key!r}: a value of type {type(value).__name__} cannot be saved: state dict leaves must be tensors, "
            "DTensors or JSON values (numbers, strings, lists, dicts); nothing is pickled"
        ) from None
    return Leaf(key, "value", local=_jsonable(value))


def _jsonable(value: Any) -> Any:
    """The value as JSON gives it back (tuples become lists), so a save and its load agree."""
    return json.loads(json.dumps(value, allow_nan=True))


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)
