"""The model's communication on ``torch.distributed``: autograd-aware TP collectives and expert-parallel dispatch.

* :class:`DistributedCollectives` implements :class:`~moeckpt.trainer.models.layers.Collectives` over a TP group
  with Megatron's semantics: ``tp_enter`` is ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce
  of the gradient), ``tp_sum`` is ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity
  backward), ``tp_max`` an all-reduce ``MAX`` without gradient.
* :func:`expert_parallel_forward` runs an :class:`~moeckpt.trainer.models.layers.Experts` block with its experts
  spread over an EP group: every (token, slot) assignment is sent with ``all_to_all_single`` to the rank owning
  its global expert, the expert MLPs run there (``Experts.forward_sorted``), and the results come back the same
  way. The backward is the transposed all-to-all, so an expert's gradient sums the tokens of every EP rank (the
  convention :mod:`moeckpt.trainer.adamw` expects).
* :func:`build_parallel_model` builds a rank's model shard with both wired in.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from moeckpt.trainer.models.layers import SINGLE_PROCESS, CausalLM, Collectives, Experts, Shard, build_model

from .parallel import ParallelGroups

__all__ = [
    "DistributedCollectives",
    "all_to_all",
    "attach_expert_parallel",
    "build_parallel_model",
    "expert_parallel_forward",
]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class DistributedCollectives(Collectives):
    """:class:`Collectives` over a tensor-parallel process group (Megatron's copy-to / reduce-from regions)."""

    def __init__(self, group, size: int) -> None:
        self.group = group
        self.size = size

    def tp_enter(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return _CopyToTP.apply(x, self.group)

    def tp_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return _ReduceFromTP.apply(x, self.group)

    def tp_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        out = x.detach().contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with explicit splits; the backward sends gradients back the way rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows ``x`` split ``in_splits`` over the group's ranks; returns what the ranks sent here (``out_splits``)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def expert_parallel_forward(
    experts: Experts, hidden: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor, *, group, ep: int
) -> torch.Tensor:
    """``Experts.forward`` with the experts spread over the ``ep`` ranks of ``group`` (same signature and result).

    Every rank of the group must call it (it is collective, in forward and backward), each with its own tokens.
    Expert ids are global; ids ``>= num_experts`` (ZAYA's skip expert) are not sent anywhere and contribute zero.
    """
    num = experts.num_experts
    per = num // ep
    k = expert_index.shape[-1]
    flat = expert_index.reshape(-1)
    # (token, slot) assignments to real experts, sorted by global expert: runs per destination rank, and within a
    # run per local expert of the destination.
    slots = (flat < num).nonzero().squeeze(-1)
    eid = flat[slots]
    order = torch.argsort(eid, stable=True)
    slots, eid = slots[order], eid[order]
    token = torch.div(slots, k, rounding_mode="floor")
    send_counts = torch.bincount(eid, minlength=num).view(ep, per)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)  # row s: what rank s sends me
    send_splits = send_counts.sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    received = all_to_all(hidden[token], recv_splits, send_splits, group)
    # Received rows come grouped by source rank, then local expert; regroup them by local expert only.
    local_expert = torch.repeat_interleave(
        torch.arange(per, device=received.device).repeat(ep), recv_counts.reshape(-1).to(received.device)
    )
    perm = torch.argsort(local_expert, stable=True)
    if received.shape[0]:
        y_sorted = experts.forward_sorted(received[perm], recv_counts.sum(0))
    else:
        # Keep the graph connected on a rank that received nothing: the backward all-to-all is collective.
        y_sorted = received * 0
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    returned = all_to_all(y_sorted[inverse], send_splits, recv_splits, group)
    returned = returned * weights.reshape(-1)[slots, None].to(returned.dtype)
    out = torch.zeros_like(hidden)
    return out.index_add(0, token, returned.to(out.dtype))


def attach_expert_parallel(model: nn.Module, group, ep: int) -> int:
    """Route every :class:`Experts` block of ``model`` through :func:`expert_parallel_forward`; returns how many.

    The override is an instance attribute, so parameter names and the state dict stay exactly the plan's.
    """
    count = 0
    if ep == 1:
        return count
    for module in model.modules():
        if isinstance(module, Experts):
            # the instance's forward replaced (not the class's): this model's experts exchange tokens over ``group``
            module.forward = functools.partial(  # type: ignore[method-assign]
                expert_parallel_forward, module, group=group, ep=ep
            )
            count += 1
    return count


def build_parallel_model(spec, groups: ParallelGroups) -> CausalLM:
    """This rank's shard of the model of ``spec`` (a ModelSpec) in ``groups.layout``, with TP collectives and EP
    dispatch attached; freshly initialised (the trainer overwrites the weights layout-independently)."""
    layout = groups.layout
    spec.check_layout(layout.tp, layout.ep)
    shard = Shard.for_rank(layout, groups.coords.rank)
    comm = DistributedCollectives(groups.tp, layout.tp) if layout.tp > 1 else SINGLE_PROCESS
    model = build_model(spec, shard, comm)
    attach_expert_parallel(model, groups.ep, layout.ep)
    return model
