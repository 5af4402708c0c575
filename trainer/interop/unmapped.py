"""``--mapping none``: a DCP checkpoint kept as it is, as a generic moeckpt checkpoint.

Every DCP tensor keeps its name and becomes one logical tensor (role ``param``); non-tensor values that are plain
JSON data go to ``train_state["dcp_values"]``, the others are dropped with a note. The model is
``{"arch": "generic", "config": {}}``, which ``inspect``, ``verify``, ``diff``, ``reshard`` and ``export-dcp``
handle without knowing a model.

This is the one place that decides how a generic import records shardings: for now every tensor gets the
replicated rule (``sharding: {}``); when the format describes DTensor shardings (mesh and placements), this
function is where the DCP chunks' sharding is recorded instead.
"""

from __future__ import annotations

from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.formats.dcp.payload import NOT_JSON
from moeckpt.formats.index import TensorEntry, check_relative_path
from moeckpt.reshard.dcp_source import whole
from moeckpt.reshard.rules import ShardingRule

from .common import Mapped, MappingError

GENERIC_ARCH = "generic"
#: the ``train_state`` key holding a generic import's non-tensor DCP values, by their DCP key.
VALUES_KEY = "dcp_values"


def safe_name(name: str, where: str) -> str:
    """Refuse a DCP key that could not be a tensor name (the zarr backend makes names into paths)."""
    try:
        check_relative_path(name, where)
    except ValueError:
        raise MappingError(
            f"{where}: DCP key {name!r} is not a safe tensor name (no '..', no leading '/', no "
            "backslash, no empty part)"
        ) from None
    if any(ord(c) < 32 for c in name):
        raise MappingError(f"{where}: DCP key {name!r} holds a control character")
    return name


def read_values(dcp: DcpCheckpoint, names, notes: list[str]) -> dict[str, object]:
    """The JSON-representable values among ``names``; the others are named in a note."""
    out, dropped = {}, []
    for name in names:
        value = dcp.read_value(name)
        if value is NOT_JSON:
            dropped.append(name)
        else:
            out[name] = value
    if dropped:
        notes.append(
            f"{len(dropped)} non-tensor value(s) are not plain JSON data and were dropped, e.g. {dropped[0]!r}"
        )
    return out


def map_generic(dcp: DcpCheckpoint) -> Mapped:
    """The ``none`` mapping: names kept, every tensor with the replicated sharding rule."""
    notes: list[str] = []
    rule = ShardingRule().to_json()
    tensors, slots = {}, []
    for name, t in dcp.tensors.items():
        safe_name(name, dcp.location)
        if not t.storable:
            raise MappingError(f"{dcp.location}: tensor {name!r} is {t.dtype}, a dtype moeckpt does not store")
        tensors[name] = TensorEntry(name=name, shape=t.shape, dtype=t.dtype, role="param", param=name, sharding=rule)
        slots.append(whole(name, t.shape))
    values = read_values(dcp, dcp.values, notes)
    return Mapped(
        model={"arch": GENERIC_ARCH, "config": {}},
        tensors=tensors,
        slots=slots,
        train_state={VALUES_KEY: values} if values else {},
        notes=notes,
    )
