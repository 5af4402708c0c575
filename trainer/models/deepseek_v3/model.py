"""The DeepSeek-V3 model for training, computing what ``transformers.DeepseekV3ForCausalLM`` computes.

Parameter names and shapes follow the plan (transformers 5's fused experts). As in the other trainable families,
every module holds only its :class:`~moeckpt.trainer.models.layers.Shard`: attention its query heads
(:mod:`.mla`), the MLPs an intermediate slice, the routed experts a global expert range, the embedding and head a
vocabulary range. The first ``first_k_dense_replace`` layers are dense, the rest MoE (:mod:`.moe`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import (
    SINGLE_PROCESS,
    CausalLM,
    Collectives,
    RMSNorm,
    Shard,
    VocabEmbedding,
    init_from_plan,
    rotary_cos_sin,
)
from .config import DeepseekV3Config
from .mla import LatentAttention
from .moe import DenseBlock, GroupLimitedRouter, MoeBlock
from .plan import param_specs
from .runtime import Runtime, runtime

__all__ = ["DeepseekV3ForCausalLM", "GroupLimitedRouter", "build"]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, rt: Runtime, layer: int, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.self_attn = LatentAttention(cfg, rt, shard, comm)
        self.mlp: nn.Module = MoeBlock(cfg, rt, shard, comm) if cfg.is_sparse(layer) else DenseBlock(cfg, shard, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, rt.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, rt.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, rt: Runtime, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, shard, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rt, i, shard, comm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, rt.rms_norm_eps)
        self.rope_dim = cfg.qk_rope_head_dim
        self.rope_theta = rt.rope_theta

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, H]`` (after the last norm)."""
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # transformers' rotary table is over the rope channels only (its head_dim is qk_rope_head_dim)
        cos, sin = rotary_cos_sin(positions, self.rope_dim, self.rope_theta, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 language model: ``forward(input_ids) -> logits`` (this rank's vocabulary slice with TP)."""

    def __init__(self, cfg: DeepseekV3Config, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> None:
        super().__init__(cfg, DeepseekV3Model(cfg, runtime(cfg), shard, comm), shard, comm)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Fill parameters as the plan says (normal with the config's std, ones, zeros: the correction bias)."""
        init_from_plan(self, param_specs(self.config), std=self.config.initializer_range, generator=generator)


def build(cfg: DeepseekV3Config, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> DeepseekV3ForCausalLM:
    """The model for ``cfg``, holding ``shard`` of it, with freshly initialised weights."""
    model = DeepseekV3ForCausalLM(cfg, shard, comm)
    model.init_weights()
    return model
