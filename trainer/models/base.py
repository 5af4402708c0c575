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
