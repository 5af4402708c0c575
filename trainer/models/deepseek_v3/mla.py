"""Multi-head latent attention (MLA), DeepSeek-V3's attention, over this rank's heads, as transformers computes it.

Queries come from a low-rank pair (``q_a_proj``, its norm, ``q_b_proj``) or one full-rank ``q_proj``; keys and
values from one latent (``kv_a_proj_with_mqa``: ``kv_lora_rank`` channels, normed, then expanded per head by
``kv_b_proj``) plus a single rotary key of ``qk_rope_head_dim`` channels that every head shares. Only the rotary
part of each query and key is rotated ("decoupled" RoPE).

Under TP the down projections and their norms are replicated and the per-head up projections column-parallel, so
each replicated activation enters the TP region (:meth:`Collectives.tp_enter`) where head-split work starts: its
gradient, partial per rank (each rank's heads only), is summed there, and the replicated weights before it get the
same full gradient on every rank, as ZeRO expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Collectives, Linear, RMSNorm, Shard, apply_rotary, causal_attention
from .config import DeepseekV3Config
from .runtime import Runtime


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's RoPE as transformers applies it with ``rope_interleave``: channel pairs ``(x0, x1), (x2, x3), ...``
    each rotated by one frequency, the results laid out de-interleaved (all first members, then all second ones),
    which is what the checkpoints' weights expect. ``cos``/``sin`` are the usual ``[T, rot]`` tables (``cat(f, f)``),
    of which the first half holds one angle per pair."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class LatentAttention(nn.Module):
    """MLA over query heads ``[start, stop)`` of this TP rank (parameter names as in transformers' state dict)."""

    def __init__(self, cfg: DeepseekV3Config, rt: Runtime, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        lo, hi = shard.tp_range(cfg.num_attention_heads, "num_attention_heads")
        n = self.num_heads = hi - lo
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.interleave = rt.rope_interleave
        bias = cfg.attention_bias
        qk = cfg.qk_head_dim
        # Registration order gives transformers' state-dict order.
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(cfg.hidden_size, n * qk)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, n * qk)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, n * (self.nope + self.v_dim))
        self.o_proj = Linear(n * self.v_dim, cfg.hidden_size, bias=bias)
        # Plain RoPE: transformers' softmax scale is 1/sqrt(qk_head_dim) (YaRN's mscale is refused by the runtime).
        self.scale = qk**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos, sin) if self.interleave else apply_rotary(x, cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(self.comm.tp_enter(x))
        else:
            q = self.q_b_proj(self.comm.tp_enter(self.q_a_layernorm(self.q_a_proj(x))))
        q = q.view(b, t, self.num_heads, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [self.nope, self.rope], dim=-1)

        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope], dim=-1)
        latent = self.comm.tp_enter(self.kv_a_layernorm(latent))
        k_rot = self.comm.tp_enter(self._rotate(k_rot.view(b, 1, t, self.rope), cos, sin))
        q_rot = self._rotate(q_rot, cos, sin)

        kv = self.kv_b_proj(latent).view(b, t, self.num_heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)
        out = self.comm.tp_sum(F.linear(causal_attention(q, k, v, self.scale), self.o_proj.weight))
        # o_proj's bias is replicated: added once, after the sum of the ranks' partial products
        return out if self.o_proj.bias is None else out + self.o_proj.bias


#: transformers builds MLA's two latent norms with DeepseekV3RMSNorm's default eps, not the config's rms_norm_eps.
_NORM_EPS = 1e-6
