"""The Mixtral parameters, named and shaped as ``transformers.MixtralForCausalLM`` (5.x) holds them.

Experts are fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``); the Hub's
per-expert ``block_sparse_moe.experts.{e}.w1/w3/w2`` layout is the Hugging Face mapping's (``hf.py``). Splits:
:mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.tensors import ParamSpec

from ..plan_parts import embedding, experts, gqa_attention, head, layer_norms, norm, replicated
from .config import MixtralConfig


def param_specs(cfg: MixtralConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h = cfg.hidden_size
    out = [embedding(cfg.vocab_size, h)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += gqa_attention(p + "self_attn.", h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        out.append(replicated(p + "mlp.gate.weight", (cfg.num_local_experts, h)))
        out += experts(p + "mlp.experts.", cfg.num_local_experts, h, cfg.intermediate_size)
        out += layer_norms(p, h)
    out.append(norm("model.norm.weight", h))
    return out + head(cfg.vocab_size, h, cfg.tie_word_embeddings)
