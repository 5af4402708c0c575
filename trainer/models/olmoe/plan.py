"""The OLMoE parameters, named and shaped as ``transformers.OlmoeForCausalLM`` (5.x) holds them.

Its q and k norms span the whole projection (all heads): their weights split with the heads they scale
(column-parallel), and a TP implementation reduces the norm's statistic over ranks. Splits: :mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.tensors import ParamSpec

from ..plan_parts import embedding, experts, gqa_attention, head, layer_norms, norm, replicated
from .config import OlmoeConfig


def param_specs(cfg: OlmoeConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h, bias = cfg.hidden_size, cfg.attention_bias
    out = [embedding(cfg.vocab_size, h)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += gqa_attention(
            p + "self_attn.",
            h,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="full",
        )
        out.append(replicated(p + "mlp.gate.weight", (cfg.num_experts, h)))
        out += experts(p + "mlp.experts.", cfg.num_experts, h, cfg.intermediate_size)
        out += layer_norms(p, h)
    out.append(norm("model.norm.weight", h))
    return out + head(cfg.vocab_size, h, cfg.tie_word_embeddings)
