"""ZAYA1 <-> Hugging Face: ``config.json`` mapping. Tensor names need no mapping: the plan uses transformers' names."""

from __future__ import annotations

from typing import Any

from ..base import config_from_json, refuse_rope_scaling, require_fields
from .config import ZayaConfig

#: config fields copied one-to-one into config.json; a checkpoint config must hold each of them to be exported.
HF_FIELDS = _SAME = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "router_hidden_size",
    "cca_time0",
    "cca_time1",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "initializer_range",
)


def to_hf_config(cfg: ZayaConfig, *, dtype: str = "float32") -> dict:
    """The ``config.json`` that ``transformers.ZayaForCausalLM`` loads for this model."""
    out: dict[str, Any] = {"architectures": ["ZayaForCausalLM"], "model_type": "zaya"}
    out.update({k: getattr(cfg, k) for k in _SAME})
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.partial_rotary_factor}
    out.update(
        hidden_act="silu",
        attention_bias=False,
        lm_head_bias=False,
        attention_dropout=0.0,
        layer_types=["hybrid"] * cfg.num_hidden_layers,
        rope_parameters={"hybrid": rope},
        dtype=dtype,
        use_cache=True,
    )
    return out


#: fields that set tensor shapes: a config.json without them cannot describe the weights.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts",
)


def from_hf_config(doc: dict) -> ZayaConfig:
    """Our config from a ZAYA ``config.json``; refuses features the trainer does not implement."""
    if doc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={doc['hidden_act']!r} is not supported (ZAYA1 uses 'silu')")
    for flag in ("attention_bias", "lm_head_bias"):
        if doc.get(flag):
            raise ValueError(f"{flag}=true is not supported by the trainer's ZAYA module")
    if any(t != "hybrid" for t in doc.get("layer_types") or ()):
        raise ValueError("layer_types other than 'hybrid' (sliding-window layers) are not supported")
    values = dict(doc)
    require_fields(values, SHAPE_FIELDS)
    rope = (doc.get("rope_parameters") or {}).get("hybrid") or {}
    refuse_rope_scaling(doc.get("rope_scaling"), rope)
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            values[key] = rope[key]
    return config_from_json(ZayaConfig, values)


def generation_config(cfg: ZayaConfig) -> dict:
    """``generation_config.json``: transformers' ZAYA token ids for the ZAYA1 vocabulary; none for another
    vocabulary (the byte-level presets), where id 106 is a letter, not the end of a sequence."""
    if cfg.vocab_size != ZayaConfig().vocab_size:  # the default is ZAYA1's tokenizer, whose ids these are
        return {}
    return {"bos_token_id": 2, "eos_token_id": 106, "pad_token_id": 0}


def export_tensors(name: str, shape: tuple[int, ...], cfg: ZayaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """HF names equal the plan's (fused experts included): one tensor each."""
    return [(name, tuple(shape))]


def export_values(name: str, tensor, cfg: ZayaConfig) -> dict:
    return {name: tensor}


def import_sources(name: str, cfg: ZayaConfig, available) -> list[str]:
    return [name]


def import_rows(name: str, cfg: ZayaConfig, available, read_rows, r0: int, r1: int):
    """Rows ``[r0, r1)`` of plan tensor ``name``: the same rows of the HF tensor of that name."""
    return read_rows(name, r0, r1)
