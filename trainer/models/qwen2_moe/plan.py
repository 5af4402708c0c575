"""The Qwen2-MoE parameters, named and shaped as ``transformers.Qwen2MoeForCausalLM`` (5.x) holds them.

The shared expert is a dense SwiGLU MLP every TP rank holds a column/row slice of, as a dense layer's MLP;
its gate (``shared_expert_gate``, one logit per token) is replicated, as the router is. Splits: :mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.tensors import ParamSpec

from ..plan_parts import dense_mlp, embedding, experts, gqa_attention, head, layer_norms, norm, replicated
from .config import Qwen2MoeConfig


def param_specs(cfg: Qwen2MoeConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h = cfg.hidden_size
    out = [embedding(cfg.vocab_size, h)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += gqa_attention(
            p + "self_attn.", h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, qkv_bias=cfg.qkv_bias
        )
        if cfg.is_sparse(layer):
            out.append(replicated(p + "mlp.gate.weight", (cfg.num_experts, h)))
            out += experts(p + "mlp.experts.", cfg.num_experts, h, cfg.moe_intermediate_size)
            out += dense_mlp(p + "mlp.shared_expert.", h, cfg.shared_expert_intermediate_size)
            out.append(replicated(p + "mlp.shared_expert_gate.weight", (1, h)))
        else:
            out += dense_mlp(p + "mlp.", h, cfg.intermediate_size)
        out += layer_norms(p, h)
    out.append(norm("model.norm.weight", h))
    return out + head(cfg.vocab_size, h, cfg.tie_word_embeddings)
