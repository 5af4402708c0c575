"""ZeRO-1 AdamW: optimizer state and fp32 master weights split along dim 0 across the (expert-)data-parallel group.

The geometry and the step's collectives are :class:`moeckpt.trainer.zero.ZeroOptimizer`'s (reduce-scatter of the
gradients to the owners, global-norm clipping, all-gather of the parameters); this module adds the update: AdamW on
the owned part of every parameter, in fp32, the same arithmetic as ``torch.optim.AdamW``'s single-tensor path
(bitwise equal to it without clipping), with the moments stored as the checkpoint roles ``exp_avg`` and
``exp_avg_sq``. :class:`moeckpt.trainer.muon.ZeroMuon` reuses it for the parameters Muon does not step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moeckpt.formats.roles import MOMENT_ROLES
from moeckpt.reshard.tensors import ParamSpec

from .parallel import ParallelGroups
from .zero import StatePiece, ZeroOptimizer, _Bucket, _Param

__all__ = ["AdamWConfig", "StatePiece", "ZeroAdamW"]


@dataclass(frozen=True, kw_only=True)
class AdamWConfig:
    """AdamW hyperparameters (the learning rate comes from the schedule at every step)."""

    #: exponential decay of the first moment.
    beta1: float = 0.9
    #: exponential decay of the second moment.
    beta2: float = 0.95
    #: added to the denominator for numerical stability.
    eps: float = 1e-8
    #: decoupled weight decay, applied as ``p *= 1 - lr * weight_decay``.
    weight_decay: float = 0.1
    #: also decay parameters with fewer than 2 dimensions (norm weights, biases, scales); off as in nanoGPT.
    decay_vectors: bool = False
    #: clip the global gradient norm to this value; ``None`` or 0 disables clipping.
    max_grad_norm: float | None = 1.0
    #: leave parameters and state untouched when the gradient norm is NaN or infinite.
    skip_nonfinite: bool = True
    #: upper bound of one flat communication bucket, in MiB (bounds the extra memory of a step).
    bucket_mib: float = 256.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"beta1={self.beta1} and beta2={self.beta2} must lie in [0, 1)")
        if self.eps <= 0:
            raise ValueError(f"eps={self.eps} must be positive")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be non-negative")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be non-negative (or None to disable)")
        if self.bucket_mib <= 0:
            raise ValueError(f"bucket_mib={self.bucket_mib} must be positive")


class ZeroAdamW(ZeroOptimizer):
    """AdamW with ZeRO-1 partitioning over the groups of a layout.

    ``params`` are the module's ``(name, tensor)`` pairs (``named_parameters()``), each TP/EP-local as the plan's
    rule cuts it; ``specs`` the plan (:class:`ParamSpec` by name, global shapes and rules). Call :meth:`step` after
    ``backward()`` with the learning rate of the step, then :meth:`zero_grad`.
    """

    name = "adamw"
    STATE_ROLES: Mapping[str, tuple[str, ...]] = {"adamw": MOMENT_ROLES}

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        specs: Mapping[str, ParamSpec] | Iterable[ParamSpec],
        groups: ParallelGroups,
        config: AdamWConfig | None = None,
        *,
        held: Collection[str] = (),
    ) -> None:
        super().__init__(params, specs, groups, config or AdamWConfig(), held=held)

    def _rule_of(self, p: _Param) -> str:
        return "adamw"

    def _update(self, lr: float, grads: Sequence[torch.Tensor]) -> None:
        for b, g in zip(self._buckets, grads):
            self._adamw(b, g, lr)

    def _adamw(self, b: _Bucket, g: torch.Tensor, lr: float) -> None:
        """torch.optim.AdamW's single-tensor arithmetic on bucket ``b``'s owned part (element-wise ops)."""
        cfg = self.config
        bc1 = 1 - cfg.beta1**self.steps
        bc2_sqrt = (1 - cfg.beta2**self.steps) ** 0.5
        exp_avg, exp_avg_sq = b.state["exp_avg"], b.state["exp_avg_sq"]
        if b.decay:
            b.master.mul_(1 - lr * cfg.weight_decay)
        exp_avg.lerp_(g, 1 - cfg.beta1)
        exp_avg_sq.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
        denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(cfg.eps)
        b.master.addcdiv_(exp_avg, denom, value=-lr / bc1)
