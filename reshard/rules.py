"""Sharding rules: how one parameter is split by a layout, as plain JSON stored in the checkpoint index.

A rule has up to two model-parallel splits, applied to the parameter's global shape:

* ``expert_dim``: the dimension holding experts, split evenly over ``ep`` ranks. Expert ``e`` is always global
  expert ``e``: a rank's box simply starts at ``ep_rank * E / ep``, so there is no local renumbering to get wrong.
* ``tp``: the tensor-parallel split, ``{"dim": d}`` plus one of
  - nothing: dimension ``d`` split evenly in ``tp`` parts;
  - ``"blocks": [b0, b1, ...]``: a fused dimension made of blocks (gate/up stacked as ``[E, 2I, H]``, q and k
    channels feeding one convolution); each block is split ``tp`` ways and a rank's local tensor is the
    concatenation of its part of every block, so one local tensor is several boxes;
  - ``"window": [offset, total]``: the tensor is rows ``[offset, offset + size)`` of a virtual dimension of size
    ``total`` that is split ``tp`` ways (ZAYA's value projection: the current and delayed halves of the value heads
    are separate tensors, and a rank owns whole heads, so it may own all of one half and none of the other).

Parameters are replicated over data-parallel ranks. Optimizer state and fp32 master weights (ZeRO-1) are further
split along dim 0 of each rank's local tensor across the (expert-)data-parallel group, ``ceil(n / group)`` rows
per part: the last part may be short and trailing parts empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from moeckpt.formats.errors import LayoutError


@dataclass(frozen=True, kw_only=True)
class TpSplit:
    """The tensor-parallel split of one parameter."""

    dim: int
    blocks: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dim": self.dim}
        if self.blocks is not None:
            out["blocks"] = list(self.blocks)
        if self.window is not None:
            out["window"] = list(self.window)
        return out


@dataclass(frozen=True, kw_only=True)
class ShardingRule:
    """How a parameter splits under a layout; ``ShardingRule()`` is fully replicated."""

    tp: TpSplit | None = None
    expert_dim: int | None = None

    @property
    def concat_dim(self) -> int | None:
        """The dimension along which a rank's boxes concatenate into its local tensor (the TP dim), or ``None``
        when TP does not split the tensor (a rank then holds one box of it)."""
        return self.tp.dim if self.tp is not None else None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tp is not None:
            out["tp"] = self.tp.to_json()
        if self.expert_dim is not None:
            out["expert_dim"] = self.expert_dim
        return out

    @classmethod
    def from_json(cls, value: object, where: str = "sharding rule") -> ShardingRule:
        if not isinstance(value, dict) or set(value) - {"tp", "expert_dim"}:
            raise LayoutError(f"{where}: expected an object with optional 'tp' and 'expert_dim', got {value!r}")
        tp = None
        if value.get("tp") is not None:
            t = value["tp"]
            if not isinstance(t, dict) or type(t.get("dim")) is not int or set(t) - {"dim", "blocks", "window"}:
                raise LayoutError(f"{where}: 'tp' must be {{'dim': int, optional 'blocks' or 'window'}}, got {t!r}")
            blocks = t.get("blocks")
            window = t.get("window")
            if blocks is not None and (
                not isinstance(blocks, list) or not all(type(b) is int and b >= 0 for b in blocks)
            ):
                raise LayoutError(f"{where}: 'tp.blocks' must be a list of non-negative integers, got {blocks!r}")
            if window is not None and (
                not isinstance(window, list) or len(window) != 2 or not all(type(w) is int and w >= 0 for w in window)
            ):
                raise LayoutError(f"{where}: 'tp.window' must be [offset, total], got {window!r}")
            if blocks is not None and window is not None:
                raise LayoutError(f"{where}: 'tp' takes 'blocks' or 'window', not both")
            tp = TpSplit(
                dim=t["dim"],
                blocks=None if blocks is None else tuple(blocks),
                window=None if window is None else (window[0], window[1]),
            )
        ed = value.get("expert_dim")
        if ed is not None and type(ed) is not int:
            raise LayoutError(f"{where}: 'expert_dim' must be an integer, got {ed!r}")
        return cls(tp=tp, expert_dim=ed)


def tp_ranges(rule: ShardingRule, shape: Sequence[int], tp: int, tp_rank: int, name: str) -> list[tuple[int, int]]:
    """The ranges of the TP dimension a rank holds, in the order its local tensor concatenates them."""
    split = rule.tp
    if split is None or tp == 1:
        size = shape[split.dim] if split is not None else 0
        return [(0, size)] if split is not None else []
    size = shape[split.dim]
    if split.window is not None:
        offset, total = split.window
        if total % tp:
            raise LayoutError(f"{name}: tp={tp} does not divide its split dimension of size {total}")
        part = total // tp
        lo = max(offset, tp_rank * part)
        hi = min(offset + size, (tp_rank + 1) * part)
        return [(lo - offset, hi - offset)] if hi > lo else [(0, 0)]
    blocks = split.blocks if split.blocks is not None else (size,)
    if sum(blocks) != size:
        raise LayoutError(f"{name}: tp blocks {list(blocks)} do not add up to dimension {split.dim} of size {size}")
    out = []
    start = 0
    for b in blocks:
        if b % tp:
            raise LayoutError(f"{name}: tp={tp} does not divide block of size {b} in dimension {split.dim}")
        part = b // tp
        out.append((start + tp_rank * part, start + (tp_rank + 1) * part))
        start += b
    return out


def check_rule(rule: ShardingRule, shape: Sequence[int], tp: int, ep: int, name: str) -> None:
    """Raise :class:`LayoutError` if the layout cannot split this parameter."""
    ndim = len(shape)
    if rule.tp is not None and not 0 <= rule.tp.dim < ndim:
        raise LayoutError(f"{name}: tp split dimension {rule.tp.dim} does not exist in shape {list(shape)}")
    if rule.expert_dim is not None:
        if not 0 <= rule.expert_dim < ndim:
            raise LayoutError(f"{name}: expert dimension {rule.expert_dim} does not exist in shape {list(shape)}")
        if rule.tp is not None and rule.tp.dim == rule.expert_dim:
            raise LayoutError(f"{name}: tp and experts cannot split the same dimension")
        if shape[rule.expert_dim] % ep:
            raise LayoutError(f"{name}: ep={ep} does not divide the {shape[rule.expert_dim]} experts")
    if rule.tp is not None:
        tp_ranges(rule, shape, tp, 0, name)
