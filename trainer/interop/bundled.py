"""A state-dict checkpoint whose tensor names are a bundled model's (Hugging Face names): which tensor is which.

A trainer that is not ours saves its model with ``moeckpt.save`` (or ``dcp.save`` through ``moeckpt.dcp``) under
the names its modules have. When those are a bundled architecture's Hugging Face names, at the top level
(``model.layers.0.mlp.gate.weight``) or under one prefix (``{"model": model.state_dict()}`` makes
``model.model.layers.0...``), ``moeckpt train --init-from`` and ``moeckpt export-hf`` use the checkpoint as that
model. AdamW moments come along when the checkpoint has them for every parameter, under the names
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives them (``<prefix>state.<param>.exp_avg``, e.g.
``optim.state.model.layers.0....exp_avg``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeckpt.formats.index import Index
from moeckpt.formats.roles import MOMENT_ROLES, PARAM

from ..models import ModelSpec
from .common import MappingError

__all__ = ["NameMap", "match_model_names"]


@dataclass(frozen=True)
class NameMap:
    """For each ``(role, parameter)`` of the model, the checkpoint tensor holding it."""

    #: (role, parameter name) -> tensor name in the checkpoint; every parameter, moments only when all are there.
    tensors: dict[tuple[str, str], str]
    #: the prefix the parameters were found under ("" at the top level).
    prefix: str

    def has_moments(self) -> bool:
        return any(role != PARAM for role, _ in self.tensors)


def _prefixes(names: set[str], first_param: str) -> list[str]:
    """Every prefix ``p`` such that ``p + first_param`` is a tensor (shortest first)."""
    return sorted({n[: -len(first_param)] for n in names if n.endswith(first_param)}, key=len)


def match_model_names(index: Index, spec: ModelSpec, where: str) -> NameMap:
    """Where the parameters of ``spec`` are in the state-dict checkpoint ``index``; refuses with one line naming the
    first parameter missing, or one whose shape differs."""
    params = spec.param_specs()
    names = set(index.tensors)
    found: dict[tuple[str, str], str] | None = None
    prefix = ""
    for prefix in _prefixes(names, params[0].name) or [""]:
        if all(prefix + p.name in names for p in params):
            found = {(PARAM, p.name): prefix + p.name for p in params}
            break
    if found is None:
        missing = next(p.name for p in params if p.name not in names)
        raise MappingError(
            f"{where}: the checkpoint does not hold the {spec.arch} model's parameters under their Hugging Face names "
            f"(no {missing!r}, at the top level or under one prefix); save the model's state dict with those names, "
            "or convert it with import-dcp --mapping"
        )
    for p in params:
        entry = index.tensors[found[(PARAM, p.name)]]
        if tuple(entry.shape) != tuple(p.shape):
            raise MappingError(
                f"{where}: {found[(PARAM, p.name)]!r} has shape {list(entry.shape)}, the {spec.arch} model's "
                f"{p.name} is {list(p.shape)}: the model config does not match the checkpoint"
            )
    # AdamW moments, as get_state_dict flattens an optimizer's state under some key (optim, optimizer, ...).
    for role in MOMENT_ROLES:
        suffix = f".{role}"
        tail = f"state.{params[0].name}{suffix}"
        candidates = sorted({n[: -len(tail)] for n in names if n.endswith(tail)}, key=len)
        for opt_prefix in candidates:
            keys = {p.name: f"{opt_prefix}state.{found[(PARAM, p.name)]}{suffix}" for p in params}
            if not all(k in names for k in keys.values()):
                keys = {p.name: f"{opt_prefix}state.{p.name}{suffix}" for p in params}
            if all(
                k in names and index.tensors[k].shape == index.tensors[found[(PARAM, n)]].shape for n, k in keys.items()
            ):
                found.update({(role, n): k for n, k in keys.items()})
                break
    if sum(role != PARAM for role, _ in found) not in (0, len(MOMENT_ROLES) * len(params)):
        found = {k: v for k, v in found.items() if k[0] == PARAM}  # only a full set of moments is usable
    return NameMap(found, prefix)
