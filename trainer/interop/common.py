"""What every DCP mapping shares: its result (:class:`Mapped`), the mapping error, and the Qwen3-MoE config that a
framework's tensor shapes imply."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moeckpt.formats.box import Box
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.dcp_source import Slot
from moeckpt.reshard.tensors import logical_tensors, tensor_name

from ..models import ModelSpec
from ..models.qwen3_moe import ARCH as QWEN3_MOE
from ..models.qwen3_moe import Qwen3MoeConfig, param_specs


class MappingError(MoeckptError, ValueError):
    """A DCP checkpoint that a named mapping cannot convert (unknown tensors, shapes that do not fit the model)."""


@dataclass
class Mapped:
    """A DCP checkpoint seen through a mapping: the logical tensors it becomes and where their bytes come from."""

    model: dict[str, Any]
    tensors: dict[str, TensorEntry]
    slots: list[Slot]
    train_state: dict[str, Any] = field(default_factory=dict)
    #: what was dropped or assumed, one sentence each (the CLI prints them).
    notes: list[str] = field(default_factory=list)


#: Qwen3-MoE fields no tensor shape tells; a mapping takes them from ``--model`` or these defaults (with a note).
UNSHAPED_FIELDS = (
    "num_experts_per_tok",
    "norm_topk_prob",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "initializer_range",
)


def qwen3_config(
    shapes: dict[str, int], tied: bool, model: ModelSpec | None, where: str, notes: list[str]
) -> Qwen3MoeConfig:
    """The Qwen3-MoE config of a checkpoint whose shapes give ``shapes`` (the shape fields), checked against
    ``model`` (``--model``) when given; the other fields come from ``model`` or the defaults, with a note."""
    fields: dict[str, Any] = dict(shapes, tie_word_embeddings=tied)
    if model is not None:
        if model.arch != QWEN3_MOE:
            raise MappingError(f"{where}: --model names a {model.arch} model, but this mapping converts into qwen3_moe")
        given = model.config.to_json()
        wrong = {k: (given[k], v) for k, v in fields.items() if given.get(k) != v}
        if wrong:
            first = next(iter(wrong))
            raise MappingError(
                f"{where}: --model gives {first}={wrong[first][0]!r} but the checkpoint's tensors imply "
                f"{wrong[first][1]!r}; pass the config the checkpoint was trained with"
            )
        return model.config
    defaults: dict[str, Any] = {
        f.name: f.default for f in dataclasses.fields(Qwen3MoeConfig) if f.name in UNSHAPED_FIELDS
    }
    defaults["num_experts_per_tok"] = min(defaults["num_experts_per_tok"], shapes["num_experts"])
    try:
        cfg = Qwen3MoeConfig(**fields, num_experts_per_tok=defaults["num_experts_per_tok"])
    except (TypeError, ValueError) as e:
        raise MappingError(f"{where}: the tensor shapes do not make a Qwen3-MoE model: {e}") from None
    notes.append(
        "model fields no tensor shape tells were set to Qwen3-MoE defaults ("
        + ", ".join(f"{k}={v}" for k, v in defaults.items())
        + "); pass --model config.json to set them"
    )
    return cfg


def qwen3_tensors(cfg: Qwen3MoeConfig, dtype: str, with_optimizer: bool) -> dict[str, TensorEntry]:
    """The logical tensors of a Qwen3-MoE checkpoint (the bundled plan's names and rules)."""
    return logical_tensors(param_specs(cfg), param_dtype=dtype, with_optimizer=with_optimizer)


def role_name(param: str, role: str) -> str:
    return tensor_name(param, role)


def check_shapes(tensors: dict, slots: list[Slot], dcp, where: str) -> None:
    """Refuse a slot whose box does not fit the logical tensor it fills (the config and the shapes disagree)."""
    for s in slots:
        entry = tensors.get(s.target)
        if entry is None:
            raise MappingError(f"{where}: {s.source} maps to {s.target}, which the model config does not have")
        end = tuple(o + n for o, n in zip(s.offsets, s.shape))
        if len(end) != len(entry.shape) or any(e > n for e, n in zip(end, entry.shape)):
            raise MappingError(
                f"{where}: {s.source} has shape {list(dcp.tensors[s.source].shape)}, which does not "
                f"fit {s.target} of shape {list(entry.shape)}"
            )


def check_covers(tensors: dict, slots: list[Slot], dcp, where: str) -> None:
    """Refuse slots that read outside their DCP tensor, or leave part of a logical tensor unfilled (a config whose
    shapes differ from the checkpoint's: a head dim, an expert size)."""
    filled = dict.fromkeys(tensors, 0)
    for s in slots:
        have = dcp.tensors[s.source].shape
        end = tuple(o + n for o, n in zip(s.region.offsets, s.region.shape))
        if len(end) != len(have) or any(e > n for e, n in zip(end, have)):
            raise MappingError(
                f"{where}: {s.source} has shape {list(have)}, smaller than the model config implies for {s.target}; "
                "pass the config the checkpoint was trained with"
            )
        filled[s.target] += s.region.numel
    short = [n for n, got in filled.items() if got != Box.full(tensors[n].shape).numel]
    if short:
        raise MappingError(
            f"{where}: {short[0]} (shape {list(tensors[short[0]].shape)}) is not filled exactly by the checkpoint's "
            f"tensors{f' ({len(short)} tensors in all)' if len(short) > 1 else ''}; pass the config the checkpoint "
            "was trained with"
        )


def qkv_group_slots(
    source: str,
    shape: tuple[int, ...],
    layer: int | None,
    prefix: str,
    role: str,
    cfg: Qwen3MoeConfig,
    param: str = "weight",
) -> list[Slot]:
    """Slots of a Q/K/V weight (or, with ``param="bias"``, bias) fused *per key/value group* (Megatron's
    ``linear_qkv``, torchtitan's ``wqkv``): for each of the G groups its H/G query heads, one key head, one value
    head, ``head_dim`` rows each. ``layer`` is the index into a leading layer dim (Megatron's stacked layers),
    ``None`` when there is none. ``cfg`` needs only the head counts and ``head_dim``."""
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    qpg = cfg.num_attention_heads // groups
    lead, drop = ((layer,), 1) if layer is not None else ((), 0)
    rest = tuple(shape[drop + 1 :])  # (hidden,) of a weight, () of a bias
    out = []
    for g in range(groups):
        base = g * (qpg + 2) * hd
        for part, lo, n, at in (
            ("q_proj", base, qpg * hd, g * qpg * hd),
            ("k_proj", base + qpg * hd, hd, g * hd),
            ("v_proj", base + (qpg + 1) * hd, hd, g * hd),
        ):
            region = Box(lead + (lo,) + (0,) * len(rest), (1,) * drop + (n, *rest))
            target = role_name(f"{prefix}self_attn.{part}.{param}", role)
            out.append(Slot(source, region, target, (at,) + (0,) * len(rest), drop))
    return out
