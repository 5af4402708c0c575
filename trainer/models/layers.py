"""Pieces every MoE model here shares: RMSNorm, rotary embeddings, the expert block, and the parallel seams.

The modules are written so tensor and expert parallelism slot in without reshaping the model:

* A :class:`Shard` says which part of the model this process holds (``tp_rank`` of ``tp``, ``ep_rank`` of ``ep``).
  Every module allocates only its local part, laid out exactly as the plan's sharding rules cut the global tensor
  (``moeckpt.reshard.placement.model_parallel_boxes``), so a checkpoint loads into it box by box.
* :class:`Collectives` is the communication a sharded module needs. This base class is the single-process
  version (every operation is the identity); a distributed trainer subclasses it with ``torch.distributed`` ops.
* :class:`Experts` is the one place that runs expert MLPs: a grouped matmul (``torch._grouped_mm``) when the
  shapes allow it, a per-expert loop otherwise, over the global expert range this process holds.
* :class:`VocabEmbedding` and :func:`vocab_logits` / :func:`cross_entropy` keep the vocabulary split behind a
  small interface (vocabulary-parallel embedding, head and loss).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moeckpt.formats.errors import LayoutError

#: label value that :func:`cross_entropy` ignores (the PyTorch and Hugging Face convention).
IGNORE_INDEX = -100


@dataclass(frozen=True, kw_only=True)
class Shard:
    """The part of the model one process holds; the default is the whole model."""

    #: tensor-parallel degree: attention heads, expert intermediate dim and vocabulary are split tp ways.
    tp: int = 1
    #: this process's position in its tensor-parallel group.
    tp_rank: int = 0
    #: expert-parallel degree: experts are split ep ways.
    ep: int = 1
    #: this process's position in its expert-parallel group.
    ep_rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, tp={self.tp})")
        if not 0 <= self.ep_rank < self.ep:
            raise ValueError(f"ep_rank={self.ep_rank} must be in [0, ep={self.ep})")

    @classmethod
    def for_rank(cls, layout, rank: int) -> Shard:
        """The shard that ``rank`` holds in a :class:`~moeckpt.reshard.layout.Layout` (its TP and EP coordinates)."""
        c = layout.coords(rank)
        return cls(tp=layout.tp, tp_rank=c.tp_rank, ep=layout.ep, ep_rank=c.ep_rank)

    def tp_range(self, size: int, what: str) -> tuple[int, int]:
        """The ``[start, stop)`` of a dimension of ``size`` split evenly over TP ranks."""
        if size % self.tp:
            raise LayoutError(f"tp={self.tp} must divide {what}={size}")
        part = size // self.tp
        return self.tp_rank * part, (self.tp_rank + 1) * part

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """The global experts ``[start, stop)`` this process holds (never renumbered from 0)."""
        if num_experts % self.ep:
            raise LayoutError(f"ep={self.ep} must divide num_experts={num_experts}")
        part = num_experts // self.ep
        return self.ep_rank * part, (self.ep_rank + 1) * part


class Collectives:
    """Communication of sharded modules; this single-process version is the identity everywhere.

    A distributed subclass implements each method as an autograd-aware collective over the TP group (forward and
    backward as in Megatron's ``copy_to/reduce_from_tensor_model_parallel_region``).
    """

    def tp_enter(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated activation entering a TP-split region: identity forward, all-reduce of the gradient."""
        return x

    def tp_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of per-rank partial results (row-parallel outputs, vocabulary-split lookups): all-reduce forward."""
        return x

    def tp_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum over the TP group, without gradient (the stabiliser of a vocab-parallel softmax)."""
        return x


SINGLE_PROCESS = Collectives()


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised parameter; models fill every tensor with :func:`init_from_plan` or a checkpoint."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype))


class Linear(nn.Module):
    """``y = x W^T (+ b)`` holding only the local rows of ``W``: column-parallel when split on the output dim,
    row-parallel (partial sums, to be :meth:`Collectives.tp_sum`-med) when split on the input dim."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMS normalisation computed in fp32 and cast back before the weight, as transformers' ``*RMSNorm``."""

    def __init__(self, size: int, eps: float, comm: Collectives = SINGLE_PROCESS) -> None:
        super().__init__()
        self.weight = empty_param(size)
        self.eps = eps
        # A replicated weight applied to TP-split activations (per-head q/k norms) gets only this rank's heads'
        # gradient; passing the TP collectives makes it enter the TP region, so its gradient is summed over ranks.
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``F.rms_norm`` without a weight is transformers' ``x.float() * rsqrt(mean(x^2) + eps)`` rounded back to
        # x's dtype (it computes in fp32 for low-precision inputs), in one fused op instead of seven; the weight is
        # applied after that rounding, as transformers does.
        h = F.rms_norm(x, (x.shape[-1],), eps=self.eps)
        return self.comm.tp_enter(self.weight) * h


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[len(positions), rotary_dim]`` of the default (unscaled) rotary embedding."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim)
    )
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [B, heads, T, D]`` (partial rotary keeps the rest)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    out = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos and sin ``[T, rot]`` widened to ``[T, head_dim]`` for :func:`apply_rotary_tables`, or None where the
    shapes do not allow it (``head_dim`` not a multiple of ``rot``).

    Built once per forward and shared by every layer: cos is 1 on the channels rotary leaves alone, sin is 0 there,
    and its first half is negated so the rotation needs no ``neg``/``cat``.
    """
    rot = cos.shape[-1]
    if rot == 0 or rot % 2 or head_dim % rot:
        return None
    half = rot // 2
    rest = head_dim - rot
    cos_e = F.pad(cos, (0, rest), value=1.0)
    sin_e = F.pad(torch.cat([-sin[..., :half], sin[..., half:]], dim=-1), (0, rest), value=0.0)
    return cos_e, sin_e


def apply_rotary_tables(x: torch.Tensor, cos_e: torch.Tensor, sin_e: torch.Tensor, rot: int) -> torch.Tensor:
    """:func:`apply_rotary` with :func:`rotary_tables`' tables (broadcast against ``x``), bit for bit.

    ``rotate_half(x_rot) * sin`` is ``cat(x2, x1) * cat(-sin1, sin2)``: swapping the halves of every ``rot``-wide
    block of channels (one ``flip``) gives ``cat(x2, x1)`` on the rotated channels, and the widened tables make the
    other channels ``x * 1 + (anything) * 0 = x``. Four kernels instead of seven, over the whole head at once.
    """
    swapped = x.unflatten(-1, (x.shape[-1] // rot, 2, rot // 2)).flip(-2).flatten(-3)
    return x * cos_e + swapped * sin_e


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention: ``q [B, H, T, D]``, ``k, v [B, KV, T, D]`` -> ``[B, T, H * D]``.

    Heads are local: with TP each rank passes its own query heads and the key/value heads they read. The attention
    kernel reads each key/value head for its group of query heads itself (``enable_gqa``, as transformers' sdpa
    path does), instead of repeated copies of k and v and a sum of their gradients.
    """
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


_GROUPED_MM_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device and dtype, probed once with a tiny call.

    The op exists on every recent build but its kernels do not: some CUDA builds have it only for Hopper, ROCm
    builds only for some GPUs, older CPU builds not at all. A build that lacks a kernel raises at call time, so
    existence (``hasattr``) is not enough; the loop in :class:`Experts` is the fallback.
    """
    key = (str(device), dtype)
    if key not in _GROUPED_MM_WORKS:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.zeros(16, 16, device=device, dtype=dtype)
                w = torch.zeros(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(x, w, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM_WORKS[key] = ok
    return _GROUPED_MM_WORKS[key]


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """``torch._grouped_mm`` wants 16-byte aligned strides; tiny or odd shapes take the loop instead."""
    if not grouped_mm_available(tensors[0].device, tensors[0].dtype):
        return False
    for t in tensors:
        item = t.element_size()
        if any((s * item) % 16 for s, n in zip(t.stride(), t.shape) if n > 1 and s != 1):
            return False
    return True


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    y = torch._grouped_mm(x, w, offs=offs)
    if y.requires_grad:
        # The backward kernel refuses broadcast (stride-0) gradients such as the one ``y.sum()`` produces.
        y.register_hook(lambda g: g.contiguous())
    return y


class Experts(nn.Module):
    """SwiGLU experts fused as transformers 5 stores them: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``.

    Holds the global experts ``[expert_start, expert_start + E_local)`` and, with TP, this rank's slice of the
    intermediate dimension (the gate and up halves each split, so ``gate_up_proj`` is ``[E_local, 2I/tp, H]``).
    With TP the output is a partial sum that the caller reduces.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, shard: Shard = Shard()) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.expert_start, self.expert_stop = shard.expert_range(num_experts)
        lo, hi = shard.tp_range(intermediate_size, "moe_intermediate_size")
        local_e, local_i = self.expert_stop - self.expert_start, hi - lo
        self.gate_up_proj = empty_param(local_e, 2 * local_i, hidden_size)
        self.down_proj = empty_param(local_e, hidden_size, local_i)
        #: ``"auto"`` picks the grouped matmul when available; ``"grouped"`` or ``"loop"`` force one (tests).
        self.implementation = "auto"

    def forward(self, hidden: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``hidden [T, H]``, ``expert_index [T, k]`` (global ids), ``weights [T, k]`` -> ``[T, H]``.

        Assignments to experts this process does not hold (other EP ranks, ZAYA's skip expert) contribute zero.

        The grouped path never waits for the GPU: every one of the ``T * k`` (token, slot) assignments keeps a row,
        sorted by local expert with the assignments held elsewhere last, and the grouped matmul's offsets come from
        the sorted ids on the device. Counting rows on the host instead (``nonzero``, ``bincount``, ``tolist``)
        would stall the CPU at every layer until the GPU caught up, so kernel launches would stop overlapping.
        """
        num_local = self.gate_up_proj.shape[0]
        k = expert_index.shape[-1]
        flat = expert_index.reshape(-1)
        if flat.numel() == 0:
            return torch.zeros_like(hidden)
        local = flat - self.expert_start
        held = (local >= 0) & (local < num_local)
        # Rows for experts held elsewhere get the id num_local, so the (stable) sort puts them after every group.
        key = torch.where(held, local, num_local)
        key, order = torch.sort(key, stable=True)
        # ends[e]: rows of local experts 0..e, the grouped matmul's offsets (searchsorted needs no host sync).
        ends = torch.searchsorted(key, torch.arange(1, num_local + 1, device=key.device), out_int32=True)
        if k == 1:
            # One slot per token: ``order`` is a permutation, so index_select's backward (index_add) hits every row
            # once, deterministic, and skips the sort that advanced indexing's accumulating backward does.
            x = hidden.index_select(0, order)
        else:
            x = hidden[torch.div(order, k, rounding_mode="floor")]
        weight = weights.reshape(-1).index_select(0, order).to(hidden.dtype)
        if self._use_grouped(x):
            y = self._grouped_offsets(x, ends, key < num_local)
        else:
            counts = torch.diff(ends, prepend=ends.new_zeros(1))
            y = self._loop(x, counts)
        y = y * weight[:, None]
        # Back to (token, slot) order; index_select by the inverse permutation is a gather (no atomics), and the
        # k slots of a token are summed in a fixed order, so the result is deterministic for any k.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0, inverse)
        if k > 1:
            y = y.view(-1, k, y.shape[-1]).sum(dim=1)
        return y

    def forward_sorted(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert MLPs of rows already grouped by local expert (``counts[e]`` rows for local expert ``e``, in
        order), unweighted: what an expert-parallel all-to-all delivers to the rank that owns the experts."""
        if self._use_grouped(x):
            return self._grouped(x, torch.cumsum(counts, 0).to(torch.int32))
        return self._loop(x, counts)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        return self.implementation == "grouped" or (
            self.implementation == "auto" and _grouped_mm_ok(x, self.gate_up_proj, self.down_proj)
        )

    def _grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = _grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        return _grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs)

    def _grouped_offsets(self, x: torch.Tensor, offs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """:meth:`_grouped` on rows whose tail (``valid`` false, past ``offs[-1]``) belongs to no local expert.

        The grouped matmul leaves such rows of its output, and of its input gradient, unwritten (uninitialised
        memory, possibly NaN). Zeroing the tail of the output hides it from the forward; zeroing the tail of the
        input makes the backward of that fill drop the tail's input gradient before it reaches ``hidden``.
        """
        valid = valid[:, None]
        y = self._grouped(x.masked_fill(~valid, 0), offs)
        return y.masked_fill(~valid, 0)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One pair of matmuls per local expert with rows; the fallback where no grouped matmul kernel exists.

        Reads ``counts`` on the host (one sync). Rows past ``counts.sum()`` (assignments to experts held
        elsewhere) come out zero.
        """
        sizes = counts.tolist()
        outs = []
        for e, chunk in enumerate(torch.split(x, [*sizes, x.shape[0] - sum(sizes)])):
            if e == len(sizes):
                outs.append(chunk.new_zeros(chunk.shape[0], self.down_proj.shape[1]))
            elif chunk.shape[0]:
                gate, up = F.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))
        return torch.cat(outs)


class VocabEmbedding(nn.Module):
    """Token embedding split by vocabulary: rank ``r`` holds rows ``[start, stop)``; others' tokens embed to zero
    here and the per-rank lookups are summed."""

    def __init__(
        self, vocab_size: int, hidden_size: int, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS
    ) -> None:
        super().__init__()
        self.vocab_start, self.vocab_stop = shard.tp_range(vocab_size, "vocab_size")
        self.split = shard.tp > 1
        self.comm = comm
        self.weight = empty_param(self.vocab_stop - self.vocab_start, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.comm.tp_sum(out)


def vocab_logits(hidden: torch.Tensor, weight: torch.Tensor, comm: Collectives = SINGLE_PROCESS) -> torch.Tensor:
    """This rank's slice of the logits, ``hidden @ weight^T`` over the vocabulary rows it holds."""
    return F.linear(comm.tp_enter(hidden), weight)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int = 0,
    comm: Collectives = SINGLE_PROCESS,
    split: bool = False,
) -> torch.Tensor:
    """Mean token cross-entropy in fp32 over targets that are not :data:`IGNORE_INDEX` (0 when there are none).

    With ``split``, ``logits`` is one rank's vocabulary slice starting at ``vocab_start``: the log-sum-exp and the
    target logit are then assembled with ``comm`` (the vocabulary-parallel loss), so the full logits never exist.
    Over the whole vocabulary it is PyTorch's fused cross-entropy on the fp32 logits, which is what transformers
    computes: the hand-assembled form would make
    about five more passes over the ``[tokens, vocab]`` fp32 logits, forward and backward, the largest tensor of
    a training step.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    valid = targets != IGNORE_INDEX
    count = valid.sum().clamp_min(1)
    if not split:
        # log_softmax with an fp32 result is cross-entropy on ``logits.float()`` (widening is exact); where the
        # kernel can, it reads the low-precision logits directly instead of materialising an fp32 copy.
        logp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        return F.nll_loss(logp, targets, ignore_index=IGNORE_INDEX, reduction="sum") / count
    logits = logits.float()
    local = targets - vocab_start
    mine = valid & (local >= 0) & (local < logits.shape[-1])
    shift = comm.tp_max(logits.detach().amax(dim=-1))
    sum_exp = comm.tp_sum((logits - shift[:, None]).exp().sum(dim=-1))
    picked = logits.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1)
    target_logit = comm.tp_sum(torch.where(mine, picked - shift, torch.zeros_like(picked)))
    losses = sum_exp.log() - target_logit
    return torch.where(valid, losses, torch.zeros_like(losses)).sum() / count


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Targets for next-token prediction: ``input_ids`` shifted left, the last position ignored."""
    return F.pad(input_ids[..., 1:], (0, 1), value=IGNORE_INDEX)


def init_from_plan(module: nn.Module, specs, *, std: float, generator: torch.Generator | None = None) -> None:
    """Fill every tensor of ``module`` (local shards included) as its plan entry says: normal(0, std), ones, zeros."""
    kinds = {s.name: s.init for s in specs}
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            kind = kinds.get(name)
            if kind is None:
                raise ValueError(f"{name}: the model holds a tensor its plan does not list")
            if t.device.type == "meta":
                continue
            if kind == "ones":
                t.fill_(1.0)
            elif kind == "zeros":
                t.zero_()
            else:
                t.normal_(0.0, std, generator=generator)


class CausalLM(nn.Module):
    """A decoder body (``self.model``) and its vocabulary-parallel head, tied to the embedding or separate.

    Every architecture's ``*ForCausalLM`` is this with its own body: ``forward(input_ids)`` gives logits (this rank's
    vocabulary slice under TP), ``loss`` the mean next-token cross-entropy.
    """

    #: the architecture's body: ``embed_tokens`` (a VocabEmbedding), ``layers``, ``norm``
    model: Any
    lm_head: Linear | None

    def __init__(self, cfg, body: nn.Module, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard
        self.comm = comm
        self.model = body
        # Tied embeddings (ZAYA1's default) have no separate head tensor in the state dict.
        vocab = self.model.embed_tokens.weight.shape[0]
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_logits(self.model(input_ids), self.head_weight, self.comm)

    def loss(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets`` default to ``input_ids`` shifted left."""
        targets = next_token_targets(input_ids) if targets is None else targets
        emb = self.model.embed_tokens
        return cross_entropy(self(input_ids), targets, vocab_start=emb.vocab_start, comm=self.comm, split=emb.split)


def build_model(spec, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> CausalLM:
    """The training module of a :class:`~moeckpt.trainer.models.ModelSpec` holding ``shard``, freshly initialised.

    Dispatches to ``<arch>/model.py``'s ``build``; imported lazily because those modules import this one.
    Under ``with torch.device("meta"):`` it allocates nothing (planning, shape checks of huge presets).
    """
    spec.require_trainable()
    return importlib.import_module(f"{spec.module.__name__}.model").build(spec.config, shard, comm)
