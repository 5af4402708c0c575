"""The ZAYA1 parameters, named and shaped exactly as ``transformers.ZayaForCausalLM`` has them, with sharding rules.

Tensor parallelism splits attention by key/value heads: q/k/o and the CCA convolutions by head, the two value
halves by the heads they feed (``value = cat([current, delayed]).view(kv_heads, head_dim)``, so with two kv heads
one TP rank owns the whole current half and the other the whole delayed half), experts by their intermediate
dimension, and the (tied) embedding by vocabulary. The router, norms and residual scales are replicated.

``matrix=`` marks the hidden weight matrices Muon orthogonalizes (``docs/trainer.md`` says why for each tensor):
the four CCA projections each on its own (the model runs them as one GEMM over their concatenation, but they are
four matrices), the output projection, the router's hidden MLP, and every expert's gate, up and down matrix
separately. The embedding (tied head), the router's classifier onto the E+1 expert logits, the convolutions and
everything that is not a matrix stay element-wise (AdamW).
"""

from __future__ import annotations

from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import Matrices, ParamSpec

from .config import ZayaConfig

REPLICATED = ShardingRule()
#: one 2-D hidden weight matrix.
MATRIX = Matrices()


def _split(dim: int, **kw) -> ShardingRule:
    return ShardingRule(tp=TpSplit(dim=dim, **kw))


def param_specs(cfg: ZayaConfig) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    r, e, i = cfg.router_hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    out = [
        ParamSpec(name="model.input_hidden_states_scale", shape=(h,), init="ones"),
        ParamSpec(name="model.input_hidden_states_bias", shape=(h,), init="zeros"),
        ParamSpec(name="model.embed_tokens.weight", shape=(cfg.vocab_size, h), rule=_split(0)),
    ]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        c = a + "qkv_proj."
        g = p + "mlp.gate."
        out += [
            ParamSpec(name=a + "o_proj.weight", shape=(h, q), rule=_split(1), matrix=MATRIX),
            ParamSpec(name=c + "q_proj.weight", shape=(q, h), rule=_split(0), matrix=MATRIX),
            ParamSpec(name=c + "k_proj.weight", shape=(kv, h), rule=_split(0), matrix=MATRIX),
            ParamSpec(
                name=c + "v_proj_current.weight", shape=(kv // 2, h), rule=_split(0, window=(0, kv)), matrix=MATRIX
            ),
            ParamSpec(
                name=c + "v_proj_delayed.weight",
                shape=(kv // 2, h),
                rule=_split(0, window=(kv // 2, kv)),
                matrix=MATRIX,
            ),
            ParamSpec(
                name=c + "conv_qk_depthwise.weight", shape=(q + kv, 1, cfg.cca_time0), rule=_split(0, blocks=(q, kv))
            ),
            ParamSpec(name=c + "conv_qk_depthwise.bias", shape=(q + kv,), rule=_split(0, blocks=(q, kv)), init="zeros"),
            ParamSpec(
                name=c + "conv_qk_grouped.weight", shape=(q + kv, hd, cfg.cca_time1), rule=_split(0, blocks=(q, kv))
            ),
            ParamSpec(name=c + "conv_qk_grouped.bias", shape=(q + kv,), rule=_split(0, blocks=(q, kv)), init="zeros"),
            ParamSpec(name=a + "qk_norm.temp", shape=(cfg.num_key_value_heads,), rule=_split(0), init="zeros"),
        ]
        if layer > 0:  # EDA: router state carried from the previous layer, which layer 0 does not have
            out.append(ParamSpec(name=g + "router_states_scale", shape=(r,), init="ones"))
        out += [
            ParamSpec(name=g + "balancing_biases", shape=(e + 1,), init="zeros"),
            ParamSpec(name=g + "down_proj.weight", shape=(r, h), matrix=MATRIX),
            ParamSpec(name=g + "down_proj.bias", shape=(r,), init="zeros"),
            ParamSpec(name=g + "router_mlp.norm.weight", shape=(r,), init="ones"),
            ParamSpec(name=g + "router_mlp.fc1.weight", shape=(r, r), matrix=MATRIX),
            ParamSpec(name=g + "router_mlp.fc1.bias", shape=(r,), init="zeros"),
            ParamSpec(name=g + "router_mlp.fc2.weight", shape=(r, r), matrix=MATRIX),
            ParamSpec(name=g + "router_mlp.fc2.bias", shape=(r,), init="zeros"),
            ParamSpec(name=g + "router_mlp.out_proj.weight", shape=(e + 1, r)),
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
            ParamSpec(name=p + "input_layernorm.weight", shape=(h,), init="ones"),
            ParamSpec(name=p + "post_attention_layernorm.weight", shape=(h,), init="ones"),
        ]
        for where in ("post_attention_residual_scale", "post_mlp_residual_scale"):
            s = p + where + "."
            out += [
                ParamSpec(name=s + "hidden_states_scale", shape=(h,), init="ones"),
                ParamSpec(name=s + "hidden_states_bias", shape=(h,), init="zeros"),
                ParamSpec(name=s + "residual_scale", shape=(h,), init="ones"),
                ParamSpec(name=s + "residual_bias", shape=(h,), init="zeros"),
            ]
    out.append(ParamSpec(name="model.norm.weight", shape=(h,), init="ones"))
    if not cfg.tie_word_embeddings:
        out.append(ParamSpec(name="lm_head.weight", shape=(cfg.vocab_size, h), rule=_split(0)))
    return out
