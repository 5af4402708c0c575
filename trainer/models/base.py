"""What every model folder provides, and the checks every MoE transformer shares."""

from __future__ import annotations

import math
import typing
from dataclasses import fields

from moeckpt.formats.errors import LayoutError

#: the largest size a config field may give one dimension: torch indexes with int64, but a dimension past this
#: is a typo (or a hostile file), never a model; refusing it here keeps it from reaching an allocation.
MAX_DIM = 2**31 - 1


def check_fields(cfg, bounds: dict[str, tuple[float, float]], *, open_low: frozenset[str] = frozenset()) -> None:
    """Check every field of a model config dataclass by its declared type, before anything is built from it:
    integers (never bools) within ``bounds`` (default ``1..MAX_DIM``), finite floats within ``bounds`` (exclusive
    at the low end for the names in ``open_low``), bools as bools. Raises ``ValueError`` naming the field."""
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value, kind = getattr(cfg, f.name), hints[f.name]
        if kind is bool:
            if type(value) is not bool:
                raise ValueError(f"{f.name}={value!r} must be true or false")
            continue
        lo, hi = bounds.get(f.name, (1, MAX_DIM))
        if kind is int:
            if type(value) is not int or not lo <= value <= hi:
                raise ValueError(f"{f.name}={value!r} must be an integer in {lo}..{hi}")
        elif kind is float:
            ok = (
                type(value) in (int, float)
                and math.isfinite(value)
                and value <= hi
                and (value > lo if f.name in open_low else value >= lo)
            )
            if not ok:
                low = f"> {lo:g}" if f.name in open_low else f">= {lo:g}"
                raise ValueError(f"{f.name}={value!r} must be a finite number {low} and <= {hi:g}")


def check_moe_layout(cfg, tp: int, ep: int) -> None:
    """Refuse a (tp, ep) that a GQA MoE transformer of config ``cfg`` cannot take, naming the fields."""
    if cfg.num_key_value_heads % tp:
        raise LayoutError(
            f"tp={tp} must divide num_key_value_heads={cfg.num_key_value_heads} "
            "(each tensor-parallel rank owns whole key/value heads)"
        )
    if cfg.vocab_size % tp:
        raise LayoutError(f"tp={tp} must divide vocab_size={cfg.vocab_size} (vocabulary-parallel embedding)")
    if cfg.moe_intermediate_size % tp:
        raise LayoutError(f"tp={tp} must divide moe_intermediate_size={cfg.moe_intermediate_size}")
    if cfg.num_experts % ep:
        raise LayoutError(f"ep={ep} must divide num_experts={cfg.num_experts}")


def config_from_json(cls, value: dict):
    """Build a config dataclass from a JSON object, ignoring keys it does not know (HF configs carry many)."""
    from dataclasses import fields

    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in value.items() if k in known})


def require_fields(doc: dict, names) -> None:
    """Raise ``ValueError`` naming the fields of ``names`` a Hugging Face config.json lacks."""
    missing = [n for n in names if doc.get(n) is None]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}, which the model's tensor shapes need")


def refuse_rope_scaling(rope_scaling, rope_parameters: dict) -> None:
    """Refuse RoPE scaling (YaRN, linear, dynamic, ...): the trainer implements plain RoPE, and importing such a
    model without it would silently change what every position computes."""
    kinds = []
    if isinstance(rope_scaling, dict):
        kinds.append(rope_scaling.get("rope_type") or rope_scaling.get("type"))
    elif rope_scaling is not None:
        kinds.append(str(rope_scaling))
    kinds.append(rope_parameters.get("rope_type"))
    scaled = [k for k in kinds if k not in (None, "default")]
    if scaled:
        raise ValueError(
            f"rope scaling {scaled[0]!r} is not supported (the trainer implements plain RoPE); the model would "
            "compute other numbers without it"
        )
