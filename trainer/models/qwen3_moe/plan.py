"""The Qwen3-MoE parameters, named and shaped as ``transformers.Qwen3MoeForCausalLM`` (5.x) has them.

Experts are fused as in transformers 5 (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj``
``[E, H, I]``); the per-expert layout of transformers 4 is handled by the Hugging Face mapping.

``matrix=`` marks the hidden weight matrices Muon orthogonalizes: q, k, v, o and every expert's gate, up and down
matrix on its own; the embedding, the untied head and the router's classifier (``mlp.gate``) stay element-wise.
"""

from __future__ import annotations

from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import Matrices, ParamSpec

from .config import Qwen3MoeConfig


def _split(dim: int, **kw) -> ShardingRule:
    return ShardingRule(tp=TpSplit(dim=dim, **kw))


MATRIX = Matrices()


def param_specs(cfg: Qwen3MoeConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    out = [ParamSpec(name="model.embed_tokens.weight", shape=(cfg.vocab_size, h), rule=_split(0))]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        out += [
            ParamSpec(name=a + "q_proj.weight", shape=(q, h), rule=_split(0), matrix=MATRIX),
            ParamSpec(name=a + "k_proj.weight", shape=(kv, h), rule=_split(0), matrix=MATRIX),
            ParamSpec(name=a + "v_proj.weight", shape=(kv, h), rule=_split(0), matrix=MATRIX),
            ParamSpec(name=a + "o_proj.weight", shape=(h, q), rule=_split(1), matrix=MATRIX),
            ParamSpec(name=a + "q_norm.weight", shape=(hd,), init="ones"),
            ParamSpec(name=a + "k_norm.weight", shape=(hd,), init="ones"),
            ParamSpec(
                name=p + "mlp.experts.gate_up_proj",
                shape=(e, 2 * i, h),
                rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(i, i))),
                matrix=Matrices(batch_dim=0, blocks=(i, i)),
            ),
            ParamSpec(
                name=p + "mlp.experts.down_proj",
                shape=(e, h, i),
                rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2)),
                matrix=Matrices(batch_dim=0),
            ),
            ParamSpec(name=p + "mlp.gate.weight", shape=(e, h)),
            ParamSpec(name=p + "input_layernorm.weight", shape=(h,), init="ones"),
            ParamSpec(name=p + "post_attention_layernorm.weight", shape=(h,), init="ones"),
        ]
    out.append(ParamSpec(name="model.norm.weight", shape=(h,), init="ones"))
    if not cfg.tie_word_embeddings:
        out.append(ParamSpec(name="lm_head.weight", shape=(cfg.vocab_size, h), rule=_split(0)))
    return out
