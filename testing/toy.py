"""A toy MoE-shaped set of tensors touching every sharding rule kind, with deterministic values."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.index import Index, TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import ParamSpec, logical_tensors

#: the step and train state every toy checkpoint records.
TOY_STEP = 7
TOY_TRAIN_STATE = {"step": 7, "consumed_samples": 112}


def toy_params() -> list[ParamSpec]:
    """Plain, fused blocks, window, experts and replicated parameters."""
    return [
        ParamSpec(name="embed.weight", shape=(16, 8), rule=ShardingRule(tp=TpSplit(dim=0))),
        ParamSpec(name="attn.o.weight", shape=(8, 12), rule=ShardingRule(tp=TpSplit(dim=1))),
        ParamSpec(name="attn.conv.weight", shape=(12, 1, 2), rule=ShardingRule(tp=TpSplit(dim=0, blocks=(8, 4)))),
        ParamSpec(name="attn.v_cur.weight", shape=(2, 8), rule=ShardingRule(tp=TpSplit(dim=0, window=(0, 4)))),
        ParamSpec(name="attn.v_del.weight", shape=(2, 8), rule=ShardingRule(tp=TpSplit(dim=0, window=(2, 4)))),
        ParamSpec(
            name="moe.experts.gate_up",
            shape=(4, 12, 8),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(6, 6))),
        ),
        ParamSpec(name="moe.experts.down", shape=(4, 8, 6), rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2))),
        ParamSpec(name="norm.weight", shape=(8,), init="ones"),
        ParamSpec(name="router.bias", shape=(5,), init="zeros"),
    ]


def toy_tensors(param_dtype: str = "bfloat16", with_optimizer: bool = True) -> dict[str, TensorEntry]:
    """The logical tensors of :func:`toy_params`, with AdamW state by default."""
    return logical_tensors(toy_params(), param_dtype=param_dtype, with_optimizer=with_optimizer)


def toy_values(seed: int = 0) -> Callable[[TensorEntry], torch.Tensor]:
    """A function giving every logical tensor a distinct, deterministic full value in its dtype."""

    def value(entry: TensorEntry) -> torch.Tensor:
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(entry.name.encode())) % (2**63))
        return torch.randn(entry.shape, generator=g).to(dtypes.to_torch(entry.dtype))

    return value


def save_toy(location: str, layout: Layout, backend: str = "safetensors", **kw: Any) -> Index:
    """Save the toy tensors at ``location`` in ``layout`` and ``backend``; returns the committed index."""
    return save_full_tensors(
        location,
        tensors=toy_tensors(),
        layout=layout,
        values=toy_values(),
        model={"arch": "toy", "config": {}},
        backend=backend,
        step=TOY_STEP,
        train_state=dict(TOY_TRAIN_STATE),
        **kw,
    )


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality, NaN-safe and dtype-exact."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
