"""The checkpoint of tests/golden/v1-tp-columns and tests/golden/v5-sliced: tensors a TP split cuts along dims 0,
1 and 2 (with fused blocks), saved at tp=1. Written before format version 5 it is version 1 (``v1-tp-columns``,
pinned by the code of before); written now it is version 5, its pieces checksummed in slices (``v5-sliced``).

Regenerate ``v5-sliced`` with ``python -m tests.formats.golden_slices DIR`` only for an intended format change.
"""

from __future__ import annotations

import sys

import torch

from moeckpt.formats.index import TensorEntry
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.save import save_full_tensors


def tensors() -> dict[str, TensorEntry]:
    def entry(name: str, shape: tuple[int, ...], dtype: str, rule: ShardingRule) -> TensorEntry:
        return TensorEntry(name=name, shape=shape, dtype=dtype, role="param", param=name, sharding=rule.to_json())

    return {
        "o": entry("o", (32, 512), "bfloat16", ShardingRule(tp=TpSplit(dim=1))),
        "gate_up": entry(
            "gate_up", (2, 64, 32), "float32", ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(32, 32)))
        ),
        "down": entry("down", (2, 32, 64), "float32", ShardingRule(expert_dim=0, tp=TpSplit(dim=2))),
        "q": entry("q", (16, 512), "float32", ShardingRule(tp=TpSplit(dim=0))),
        "norm": entry("norm", (8,), "float32", ShardingRule()),
    }


def value(entry: TensorEntry) -> torch.Tensor:
    n = 1
    for s in entry.shape:
        n *= s
    base = sum(map(ord, entry.name))
    return (
        ((torch.arange(n, dtype=torch.float32) * 0.25 + base) % 997)
        .reshape(entry.shape)
        .to(torch.bfloat16 if entry.dtype == "bfloat16" else torch.float32)
    )


def write(location: str) -> None:
    save_full_tensors(
        location,
        tensors=tensors(),
        layout=Layout(tp=1, ep=1, dp=1),
        values=value,
        model={"arch": "toy", "config": {}},
        step=7,
        train_state={"step": 7},
    )


if __name__ == "__main__":
    write(sys.argv[1])
