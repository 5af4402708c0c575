"""What every model folder provides, and the checks every MoE transformer shares."""

from __future__ import annotations

from moeckpt.formats.errors import LayoutError


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
