"""Small collectives for coordination: JSON values over a process group.

``torch.distributed.all_gather_object`` serialises arbitrary Python objects, and reading them back can run code;
a checkpoint layer that promises data-only formats must not do that with what another process sent. These
helpers send UTF-8 JSON in uint8 tensors over a (gloo) group. They live in ``reshard`` because the collective
load agrees on errors with them; the trainer coordinates its saves and resumes with them too.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def all_gather_json(value: Any, group=None) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. The group must be a CPU (gloo) group."""
    if not is_distributed():
        return [value]
    data = json.dumps(value, separators=(",", ":")).encode()
    n = world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(bytes(b[: int(s.item())].numpy()).decode()) for b, s in zip(bufs, sizes)]


def broadcast_json(value: Any, src: int = 0, group=None) -> Any:
    """``value`` of rank ``src`` on every rank."""
    if not is_distributed():
        return value
    return all_gather_json(value if rank() == src else None, group)[
        dist.get_group_rank(group, src) if group is not None else src
    ]


def barrier(group=None) -> None:
    if is_distributed():
        dist.barrier(group=group)
