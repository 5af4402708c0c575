"""Qwen3-MoE <-> Hugging Face: ``config.json`` mapping and the two expert layouts.

transformers 5 stores experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``,
the names our plan uses); transformers 4 and the published Qwen checkpoints store them per expert
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), which transformers 5 also loads (its conversion mapping fuses
them at load time). Exports use the per-expert layout so both versions load the result.
"""

from __future__ import annotations

from typing import Any

from ..base import config_from_json, refuse_rope_scaling, require_fields
from ..hf_layout import ExpertLayout
from .config import Qwen3MoeConfig

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
    "norm_topk_prob",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "initializer_range",
)


def to_hf_config(cfg: Qwen3MoeConfig, *, dtype: str = "float32") -> dict:
    """A ``config.json`` both transformers 4.x and 5.x load: ``num_experts`` and ``num_local_experts``, and
    ``rope_theta`` at the top level as well as in ``rope_parameters``."""
    out: dict[str, Any] = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}
    out.update({k: getattr(cfg, k) for k in _SAME})
    out.update(
        num_local_experts=cfg.num_experts,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rope_scaling=None,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        # Every layer is a MoE layer; the dense-MLP size is unused but transformers 4 requires the field.
        decoder_sparse_step=1,
        mlp_only_layers=[],
        intermediate_size=cfg.moe_intermediate_size * cfg.num_experts_per_tok,
        use_sliding_window=False,
        sliding_window=None,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        dtype=dtype,
        torch_dtype=dtype,
        use_cache=True,
    )
    return out


#: fields that set tensor shapes: a config.json without them cannot describe the weights, and our defaults (the
#: 30B-A3B shape) would only move the error to a confusing "tensor ... is missing".
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
)


def from_hf_config(doc: dict) -> Qwen3MoeConfig:
    """Our config from a Qwen3-MoE ``config.json``; refuses features the trainer does not implement."""
    if doc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={doc['hidden_act']!r} is not supported (Qwen3-MoE uses 'silu')")
    if doc.get("attention_bias"):
        raise ValueError("attention_bias=true is not supported by the trainer's Qwen3-MoE module")
    if doc.get("mlp_only_layers") or doc.get("decoder_sparse_step", 1) != 1:
        raise ValueError("dense (mlp_only) layers are not supported: every layer must be a MoE layer")
    if doc.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported")
    values = dict(doc)
    if "num_experts" not in values and "num_local_experts" in values:
        values["num_experts"] = values["num_local_experts"]
    require_fields(values, SHAPE_FIELDS)
    rope = doc.get("rope_parameters") or {}
    refuse_rope_scaling(doc.get("rope_scaling"), rope)
    if "rope_theta" not in values and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    if not values.get("head_dim"):
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    return config_from_json(Qwen3MoeConfig, values)


def generation_config(cfg: Qwen3MoeConfig) -> dict:
    """``generation_config.json``: no token ids are known for a trainer-made vocabulary."""
    return {}


#: the expert layouts' mapping functions (see :class:`~moeckpt.trainer.models.hf_layout.ExpertLayout`).
_LAYOUT = ExpertLayout(count=lambda cfg: cfg.num_experts)
export_tensors = _LAYOUT.export_tensors
export_values = _LAYOUT.export_values
import_sources = _LAYOUT.import_sources
import_source_shapes = _LAYOUT.import_source_shapes
import_rows = _LAYOUT.import_rows
