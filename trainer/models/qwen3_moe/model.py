"""The Qwen3-MoE model for training, computing exactly what ``transformers.Qwen3MoeForCausalLM`` computes.

Parameter names and shapes follow the plan (transformers 5's fused experts). As in the ZAYA module, every module
holds only its :class:`~moeckpt.trainer.models.layers.Shard`: attention the key/value heads ``[kv_start, kv_stop)``
and the query heads that read them, experts a global expert range, the embedding and head a vocabulary range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    SINGLE_PROCESS,
    CausalLM,
    Collectives,
    Experts,
    Linear,
    RMSNorm,
    Shard,
    VocabEmbedding,
    apply_rotary,
    causal_attention,
    init_from_plan,
    rotary_cos_sin,
)
from .config import Qwen3MoeConfig
from .plan import param_specs


class Attention(nn.Module):
    """GQA attention with per-head RMS norms on q and k, over this rank's heads."""

    def __init__(self, cfg: Qwen3MoeConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        hd = cfg.head_dim
        kv_lo, kv_hi = shard.tp_range(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = hd
        self.num_kv = kv_hi - kv_lo
        self.num_heads = self.num_kv * (cfg.num_attention_heads // cfg.num_key_value_heads)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * hd)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv * hd)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv * hd)
        self.o_proj = Linear(self.num_heads * hd, cfg.hidden_size)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, comm)  # per-head: applied to this rank's heads only
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, comm)
        self.scale = hd**-0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = self.comm.tp_enter(x)
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.comm.tp_sum(self.o_proj(causal_attention(q, k, v, self.scale)))


class TopKRouter(nn.Module):
    """Softmax over experts in fp32, top-k, optionally renormalised over the chosen k (``norm_topk_prob``)."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (logits ``[T, E]``, weights ``[T, k]``, expert index ``[T, k]``)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        # Registration order gives transformers' state-dict order (experts before gate).
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, shard)
        self.gate = TopKRouter(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        _, weights, index = self.gate(flat)
        # The routing weights scale each TP rank's partial expert output, so their gradient is a TP sum too.
        out = self.experts(self.comm.tp_enter(flat), index, self.comm.tp_enter(weights))
        return self.comm.tp_sum(out).view(b, t, h)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, shard, comm)
        self.mlp = SparseMoeBlock(cfg, shard, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, shard, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, shard, comm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, H]`` (after the last norm)."""
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE language model: ``forward(input_ids) -> logits`` (this rank's vocabulary slice with TP)."""

    def __init__(self, cfg: Qwen3MoeConfig, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> None:
        super().__init__(cfg, Qwen3MoeModel(cfg, shard, comm), shard, comm)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Fill parameters as the plan says (normal with the config's std, ones, zeros)."""
        init_from_plan(self, param_specs(self.config), std=self.config.initializer_range, generator=generator)


def build(cfg: Qwen3MoeConfig, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> Qwen3MoeForCausalLM:
    """The model for ``cfg``, holding ``shard`` of it, with freshly initialised weights."""
    model = Qwen3MoeForCausalLM(cfg, shard, comm)
    model.init_weights()
    return model
