"""From a model's parameter list to the logical tensors of a checkpoint (parameters plus optimizer state)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import MASTER, MOMENT_ROLES, PARAM

from .layout import Layout
from .placement import check_tensor
from .rules import ShardingRule


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """One model parameter as a sharding plan sees it."""

    #: the Hugging Face-style name, e.g. ``model.layers.0.mlp.experts.gate_up_proj``.
    name: str
    #: global (unsharded) shape.
    shape: tuple[int, ...]
    #: how a layout splits it.
    rule: ShardingRule = field(default_factory=ShardingRule)
    #: how ``moeckpt init`` fills it: ``normal`` (std 0.02), ``ones`` or ``zeros``.
    init: str = "normal"


def tensor_name(param: str, role: str) -> str:
    """The layout-independent name of a logical tensor: the parameter name, prefixed by the role if not a param."""
    return param if role == PARAM else f"{role}/{param}"


def logical_tensors(
    params: Iterable[ParamSpec], *, param_dtype: str = "float32", with_optimizer: bool = False
) -> dict[str, TensorEntry]:
    """Every logical tensor of a checkpoint of these parameters."""
    roles = [PARAM]
    if with_optimizer:
        if param_dtype != "float32":
            roles.append(MASTER)  # an fp32 parameter is its own master copy
        roles.extend(MOMENT_ROLES)
    out: dict[str, TensorEntry] = {}
    for p in params:
        for role in roles:
            name = tensor_name(p.name, role)
            out[name] = TensorEntry(
                name=name,
                shape=tuple(p.shape),
                dtype=param_dtype if role == PARAM else "float32",
                role=role,
                param=p.name,
                sharding=p.rule.to_json(),
            )
    return out


def check_layout(tensors: dict[str, TensorEntry], layout: Layout) -> None:
    """Raise :class:`~moeckpt.formats.errors.LayoutError` naming the first tensor the layout cannot split."""
    for entry in tensors.values():
        if entry.role == PARAM:
            check_tensor(entry, layout)
