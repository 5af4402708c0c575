"""DeepSeek-V3's feed-forward blocks: the dense SwiGLU MLP of the first layers, and the MoE block (shared experts plus
routed experts chosen by a sigmoid router with group-limited top-k and a load-balancing correction bias).

The router computes in fp32 (transformers keeps ``gate.weight`` and the bias in fp32 and casts the input up). The
correction bias ``e_score_correction_bias`` only decides which experts a token goes to; the weights are the plain
sigmoid scores of the chosen experts. It is a parameter the optimizer never steps (``requires_grad=False``, no
optimizer state): :mod:`moeckpt.trainer.balancing` moves it between steps from the load the router counts here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import Collectives, Experts, Linear, Shard
from .config import DeepseekV3Config
from .runtime import Runtime


class DenseMlp(nn.Module):
    """SwiGLU MLP split by its intermediate channels (gate/up column-, down row-parallel); the result is this
    rank's partial sum, which the caller reduces."""

    def __init__(self, hidden: int, intermediate: int, shard: Shard, what: str) -> None:
        super().__init__()
        lo, hi = shard.tp_range(intermediate, what)
        self.gate_proj = Linear(hidden, hi - lo)
        self.up_proj = Linear(hidden, hi - lo)
        self.down_proj = Linear(hi - lo, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DenseBlock(DenseMlp):
    """A dense layer's MLP (``mlp.gate_proj`` ...), entering and leaving the TP region itself."""

    def __init__(self, cfg: DeepseekV3Config, shard: Shard, comm: Collectives) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, shard, "intermediate_size")
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.tp_sum(super().forward(self.comm.tp_enter(x)))


class GroupLimitedRouter(nn.Module):
    """Sigmoid scores; experts chosen from the ``topk_group`` best of ``n_group`` groups (a group scored by its two
    best biased scores), then the ``num_experts_per_tok`` best biased scores among them; the weights are the
    unbiased scores of the chosen, renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``."""

    load: torch.Tensor

    def __init__(self, cfg: DeepseekV3Config, rt: Runtime) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(e), requires_grad=False)
        self.rt = rt
        self.num_experts = e
        #: assignments per expert counted by training forwards since :meth:`take_load` (int64, not in the state
        #: dict: a step consumes it before any checkpoint, so a resume needs none).
        self.register_buffer("load", torch.zeros(e, dtype=torch.int64), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (weights ``[T, k]`` in fp32, global expert index ``[T, k]``)."""
        rt, e = self.rt, self.num_experts
        counting = self.training and torch.is_grad_enabled()  # a training step's forward, not an evaluation
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        with torch.no_grad():
            choice = scores.detach() + self.e_score_correction_bias.float()
            groups = choice.view(-1, rt.n_group, e // rt.n_group)
            group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(rt.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(e // rt.n_group, dim=1), float("-inf"))
            index = choice.topk(rt.num_experts_per_tok, dim=-1, sorted=False)[1]
            if counting:
                # index_add, not bincount: bincount sizes its output from the data, a host sync on a GPU
                flat = index.reshape(-1)
                self.load.index_add_(0, flat, torch.ones_like(flat))
        weights = scores.gather(1, index)
        if rt.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * rt.routed_scaling_factor, index

    def take_load(self) -> torch.Tensor:
        """The counted load (a copy), the counter reset."""
        out = self.load.clone()
        self.load.zero_()
        return out


class MoeBlock(nn.Module):
    """Routed experts (over EP ranks, and split by TP like Qwen3-MoE's) plus the shared experts as one dense MLP;
    both partial under TP, so one all-reduce sums them."""

    def __init__(self, cfg: DeepseekV3Config, rt: Runtime, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        # Registration order gives transformers' state-dict order (experts, gate, shared experts).
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, shard)
        self.gate = GroupLimitedRouter(cfg, rt)
        self.shared_experts = (
            DenseMlp(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, shard, "moe_intermediate_size")
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        weights, index = self.gate(flat)
        local = self.comm.tp_enter(flat)
        # The routing weights scale each TP rank's partial expert output, so their gradient is a TP sum too.
        out = self.experts(local, index, self.comm.tp_enter(weights.to(x.dtype)))
        if self.shared_experts is not None:
            out = out + self.shared_experts(local)
        return self.comm.tp_sum(out).view(b, t, h)
