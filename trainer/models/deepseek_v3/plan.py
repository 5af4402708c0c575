"""The DeepSeek-V3 parameters, named and shaped as ``transformers.DeepseekV3ForCausalLM`` (5.x) holds them.

Multi-head latent attention under TP: the low-rank down projections (``q_a_proj``, ``kv_a_proj_with_mqa``, whose
last ``qk_rope_head_dim`` rows are the one shared rotary key) and their norms feed every head, so they are
replicated; the up projections (``q_b_proj`` or the full-rank ``q_proj``, and ``kv_b_proj``) are column-parallel
by head, and ``o_proj`` row-parallel. MoE layers: the router and its correction bias replicated, the shared
experts (``n_shared_experts`` experts as one MLP) split like a dense MLP, the routed experts fused. The correction
bias is moved by a balancing rule, not a gradient (:func:`untrained`). Other splits: :mod:`..plan_parts`.
"""

from __future__ import annotations

from moeckpt.reshard.tensors import ParamSpec

from ..plan_parts import column, dense_mlp, embedding, experts, head, layer_norms, norm, replicated, row
from .config import DeepseekV3Config


def mla(prefix: str, cfg: DeepseekV3Config) -> list[ParamSpec]:
    """Multi-head latent attention under ``prefix`` (``model.layers.L.self_attn.``)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    kv_a = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    out = []
    if cfg.q_lora_rank is None:
        out.append(column(prefix + "q_proj.weight", (n * cfg.qk_head_dim, h), matrix=True))
    else:
        out.append(replicated(prefix + "q_a_proj.weight", (cfg.q_lora_rank, h), matrix=True))
        if cfg.attention_bias:
            out.append(replicated(prefix + "q_a_proj.bias", (cfg.q_lora_rank,), init="zeros"))
        out += [
            norm(prefix + "q_a_layernorm.weight", cfg.q_lora_rank),
            column(prefix + "q_b_proj.weight", (n * cfg.qk_head_dim, cfg.q_lora_rank), matrix=True),
        ]
    out.append(replicated(prefix + "kv_a_proj_with_mqa.weight", (kv_a, h), matrix=True))
    if cfg.attention_bias:
        out.append(replicated(prefix + "kv_a_proj_with_mqa.bias", (kv_a,), init="zeros"))
    out += [
        norm(prefix + "kv_a_layernorm.weight", cfg.kv_lora_rank),
        column(
            prefix + "kv_b_proj.weight", (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), matrix=True
        ),
        row(prefix + "o_proj.weight", (h, n * cfg.v_head_dim)),
    ]
    if cfg.attention_bias:
        out.append(replicated(prefix + "o_proj.bias", (h,), init="zeros"))
    return out


def param_specs(cfg: DeepseekV3Config) -> list[ParamSpec]:
    """Every parameter of the model, in the order transformers' state dict lists them."""
    h, e = cfg.hidden_size, cfg.n_routed_experts
    out = [embedding(cfg.vocab_size, h)]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        out += mla(p + "self_attn.", cfg)
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


def untrained(cfg: DeepseekV3Config) -> list[str]:
    """The routing correction biases: state of the model, moved by the balancing rule, never by an optimizer."""
    return [
        f"model.layers.{x}.mlp.gate.e_score_correction_bias" for x in range(cfg.num_hidden_layers) if cfg.is_sparse(x)
    ] + [n for n in cfg.mtp_tensors if n.endswith(".e_score_correction_bias")]
