"""The gpt-oss parameters, named and shaped as ``transformers.GptOssForCausalLM`` (5.x) holds them (bf16 weights;
the Hub's MXFP4 expert blocks are refused on import).

Its experts are stored input-major and biased: ``gate_up_proj [E, H, 2I]`` whose last dimension interleaves gate
and up (gate channel ``j`` at ``2j``, up at ``2j + 1``), ``gate_up_proj_bias [E, 2I]`` likewise, ``down_proj
[E, I, H]`` and ``down_proj_bias [E, H]``. An even TP split of the interleaved dimension gives each rank the gate
and up columns of the same intermediate channels, so it is a plain split (no blocks); the down projection's bias
is added once after the TP sum, so it is split over experts only. The attention sinks (one logit per query head)
split with their heads; the router and its bias are replicated. Other splits: :mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import Matrices, ParamSpec

from ..plan_parts import embedding, gqa_attention, head, layer_norms, norm, replicated
from .config import GptOssConfig


def experts(prefix: str, e: int, h: int, i: int) -> list[ParamSpec]:
    """gpt-oss's biased, interleaved experts (see the module docstring)."""
    return [
        # the interleaved gate/up columns are not two blocks an optimizer could step apart: one matrix per expert
        ParamSpec(
            name=prefix + "gate_up_proj",
            shape=(e, h, 2 * i),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2)),
            matrix=Matrices(batch_dim=0),
        ),
        ParamSpec(
            name=prefix + "gate_up_proj_bias",
            shape=(e, 2 * i),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1)),
            init="zeros",
        ),
        ParamSpec(
            name=prefix + "down_proj",
            shape=(e, i, h),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1)),
            matrix=Matrices(batch_dim=0),
        ),
        ParamSpec(name=prefix + "down_proj_bias", shape=(e, h), rule=ShardingRule(expert_dim=0), init="zeros"),
    ]


def param_specs(cfg: GptOssConfig) -> list[ParamSpec]:
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
            sinks=True,
        )
        out += [
            replicated(p + "mlp.router.weight", (cfg.num_local_experts, h)),
            replicated(p + "mlp.router.bias", (cfg.num_local_experts,), init="zeros"),
        ]
        out += experts(p + "mlp.experts.", cfg.num_local_experts, h, cfg.intermediate_size)
        out += layer_norms(p, h)
    out.append(norm("model.norm.weight", h))
    return out + head(cfg.vocab_size, h, cfg.tie_word_embeddings)
