"""The GLM-4.5 parameters, named and shaped as ``transformers.Glm4MoeForCausalLM`` (5.x) holds them.

GQA attention (q/k/v biases with ``attention_bias``; ``o_proj`` never biased; per-head q/k norms with
``use_qk_norm``, replicated), then DeepSeek-V3's MoE block: router and correction bias replicated, shared experts
split like a dense MLP, routed experts fused. Splits: :mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.tensors import ParamSpec

from ..plan_parts import dense_mlp, embedding, experts, gqa_attention, head, layer_norms, norm, replicated
from .config import Glm4MoeConfig


def param_specs(cfg: Glm4MoeConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h, e = cfg.hidden_size, cfg.n_routed_experts
    out = [embedding(cfg.vocab_size, h)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += gqa_attention(
            p + "self_attn.",
            h,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.attention_bias,
            qk_norm="head" if cfg.use_qk_norm else None,
        )
        if cfg.is_sparse(layer):
            out += experts(p + "mlp.experts.", e, h, cfg.moe_intermediate_size)
            out += [
                replicated(p + "mlp.gate.weight", (e, h)),
                replicated(p + "mlp.gate.e_score_correction_bias", (e,), init="zeros"),
            ]
            if cfg.n_shared_experts:
                out += dense_mlp(p + "mlp.shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            out += dense_mlp(p + "mlp.", h, cfg.intermediate_size)
        out += layer_norms(p, h)
    out.append(norm("model.norm.weight", h))
    out += head(cfg.vocab_size, h, cfg.tie_word_embeddings)
    # multi-token-prediction layers the checkpoint holds past the model's layers: carried whole
    return out + [replicated(n, shape) for n, shape in cfg.mtp_tensors.items()]


def untrained(cfg: Glm4MoeConfig) -> list[str]:
    """The routing correction biases: state of the model, moved by the balancing rule, never by an optimizer."""
    return [
        f"model.layers.{x}.mlp.gate.e_score_correction_bias" for x in range(cfg.num_hidden_layers) if cfg.is_sparse(x)
    ] + [n for n in cfg.mtp_tensors if n.endswith(".e_score_correction_bias")]
