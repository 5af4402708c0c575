"""Will a run fit? A lower bound of what a training (or evaluation) rank allocates, checked before allocating.

A model or batch far too large for the host is otherwise found by the kernel's OOM killer after minutes of
allocation, with nothing on the terminal. The estimate counts only what surely exists (parameters, gradients,
optimizer state, the logits and one activation per layer of the rank's micro-batch), so a refusal is never
a false alarm: whatever is refused would not have fit.
"""

from __future__ import annotations

import os

from moeckpt.formats.errors import MoeckptError

__all__ = ["MemoryBudgetError", "available_bytes", "check_fits", "training_bytes"]


class MemoryBudgetError(MoeckptError, MemoryError, ValueError):
    """The run needs more memory than the host (or GPU) has, or the memory tier's directory cannot hold
    ``--memory-keep`` memory checkpoints (:mod:`.memory_tier`). A ``MemoryError`` and, as the memory tier's budget
    refusal always was, a ``ValueError``."""


def available_bytes() -> int | None:
    """Memory a new allocation can still get on this host (``MemAvailable``), or ``None`` when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # no /proc (not Linux) or a format we do not know: ask sysconf instead
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def training_bytes(
    spec,
    *,
    tp: int,
    ep: int,
    dp: int,
    micro_batch: int,
    seq_len: int,
    param_bytes: int,
    optimizer: bool = True,
    params: int | None = None,
) -> int:
    """A lower bound of one rank's memory: its share of parameters and gradients, its ZeRO-1 share of the fp32
    optimizer state (and master weights when parameters are narrower), the fp32 logits of its micro-batch and one
    activation per layer. ``params``: the model's parameter count, when the caller has it already."""
    if params is None:
        params = sum(_numel(p.shape) for p in spec.param_specs())
    local = params // max(1, tp * ep)  # the most a layout can split them (dense by tp, experts by tp and ep)
    total = local * param_bytes
    if optimizer:
        total += local * param_bytes  # gradients
        state = 8 + (4 if param_bytes < 4 else 0)  # exp_avg, exp_avg_sq (and master) in fp32
        total += local * state // max(1, dp)
    cfg = spec.config
    tokens = micro_batch * seq_len
    vocab = getattr(cfg, "vocab_size", 0) // max(1, tp)
    hidden = getattr(cfg, "hidden_size", 0)
    layers = getattr(cfg, "num_hidden_layers", 0)
    total += tokens * vocab * 4 + tokens * hidden * layers * param_bytes
    return total


def check_fits(need_per_rank: int, *, ranks_here: int, device_type: str, what: str, fix: str) -> None:
    """Raise :class:`MemoryBudgetError` when ``ranks_here`` ranks of ``need_per_rank`` bytes cannot fit."""
    if device_type == "cuda":
        import torch

        try:
            have = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        except (RuntimeError, AssertionError):
            return
        need, where = need_per_rank, "one GPU"
    else:
        free = available_bytes()
        if free is None:
            return
        have = free
        need, where = need_per_rank * ranks_here, f"this host ({ranks_here} rank(s))"
    if need > have:
        raise MemoryBudgetError(
            f"{what} needs at least {need / 1e9:,.1f} GB on {where}, which has {have / 1e9:,.1f} GB available; {fix}"
        )
