"""From a model's parameter list to the logical tensors of a checkpoint (parameters plus optimizer state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import MASTER, MOMENT_ROLES, PARAM

from .layout import Layout
from .placement import check_tensor
from .rules import ShardingRule


@dataclass(frozen=True, kw_only=True)
class Matrices:
    """The 2-D matrices a parameter is made of, for optimizers that treat each matrix whole (Muon).

    ``Matrices()`` is the whole 2-D tensor. ``batch_dim=0`` makes a 3-D tensor one matrix per index of dim 0 (the
    experts of ``[E, rows, cols]``); ``blocks`` splits the first matrix dimension (dim 1 when batched, else 0) into
    logical matrices of those row counts (gate and up stacked as ``[E, 2I, H]`` are ``blocks=(I, I)``).
    """

    #: ``0``: one matrix per index of dim 0 (experts); ``None``: the tensor is one 2-D matrix (or its blocks).
    batch_dim: int | None = None
    #: row counts of the logical matrices stacked along the first matrix dimension; ``None``: one block.
    blocks: tuple[int, ...] | None = None


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
    #: the hidden weight matrices it holds (Muon steps them); ``None``: not a hidden matrix (embeddings, output
    #: layers, norms, biases, scales, convolutions), stepped element-wise (AdamW).
    matrix: Matrices | None = None


def tensor_name(param: str, role: str) -> str:
    """The layout-independent name of a logical tensor: the parameter name, prefixed by the role if not a param."""
    return param if role == PARAM else f"{role}/{param}"


def logical_tensors(
    params: Iterable[ParamSpec],
    *,
    param_dtype: str = "float32",
    with_optimizer: bool = False,
    optimizer_roles: Callable[[str], Sequence[str]] | None = None,
) -> dict[str, TensorEntry]:
    """Every logical tensor of a checkpoint of these parameters.

    ``optimizer_roles(name)`` gives the optimizer roles stored for each parameter (``master`` included where it
    applies), for optimizers whose state differs by parameter (Muon's ``momentum`` beside AdamW's moments); without
    it, ``with_optimizer`` adds ``master`` (non-fp32) and AdamW's :data:`MOMENT_ROLES` to every parameter.
    """
    roles = [PARAM]
    if with_optimizer:
        if param_dtype != "float32":
            roles.append(MASTER)  # an fp32 parameter is its own master copy
        roles.extend(MOMENT_ROLES)
    out: dict[str, TensorEntry] = {}
    for p in params:
        for role in roles if optimizer_roles is None else ["param", *optimizer_roles(p.name)]:
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
