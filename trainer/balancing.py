"""Auxiliary-loss-free load balancing (DeepSeek-V3): after every optimizer step, each MoE layer's routing correction
bias moves a fixed amount towards balanced load,

    bias_e += rate * sign(mean_load - load_e)

where ``load_e`` counts the (token, slot) assignments the layer's router sent to expert ``e`` during the step, over
the whole global batch. The bias only decides which experts a token goes to, so the rule, not a gradient, moves it
(the model's ``untrained()`` parameters: no optimizer state, saved and restored as weights).

The counts are integers summed over the data-parallel group (the ranks holding distinct tokens; the TP ranks of a
group route the same tokens identically, and an EP group is part of the data-parallel group), so every rank of
every layout sees the same total and applies the same update: the biases stay bitwise equal across ranks and
across layouts. DeepSeek-V3 trained with ``rate = 0.001`` (its paper's bias update speed) for most of its tokens;
``--bias-update-rate`` sets it, 0 holds the biases fixed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BalancedRouter", "balance_routers", "balanced_routers"]


class BalancedRouter(Protocol):
    """A router that counts its load and carries a correction bias (DeepSeek-V3's ``GroupLimitedRouter``)."""

    e_score_correction_bias: torch.Tensor

    def take_load(self) -> torch.Tensor:
        """Assignments per expert since the last call (int64 ``[experts]``), the counter reset."""
        ...


def balanced_routers(model: nn.Module) -> list[BalancedRouter]:
    """The routers of ``model`` that count their load and carry a correction bias, in module order."""
    found = [m for m in model.modules() if hasattr(m, "take_load") and hasattr(m, "e_score_correction_bias")]
    return cast("list[BalancedRouter]", found)


@torch.no_grad()
def balance_routers(routers: Sequence[BalancedRouter], rate: float, group=None, *, group_size: int = 1) -> None:
    """Apply the balancing rule to every router's bias from the load counted since the last call (collective over
    ``group``, the data-parallel group of ``group_size`` ranks, when that is more than one; every rank calls it
    with the same ``rate``)."""
    if not routers:
        return
    load = torch.stack([r.take_load() for r in routers])  # [layers, experts], int64; the counters reset
    if rate == 0:
        return
    if group_size > 1:
        dist.all_reduce(load, group=group)
    load = load.double()
    step = torch.sign(load.mean(dim=-1, keepdim=True) - load) * rate
    for r, s in zip(routers, step):
        bias = r.e_score_correction_bias
        bias.copy_((bias.double() + s).to(bias.dtype))
