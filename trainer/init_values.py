"""Deterministic initial values for ``moeckpt init``: a function of (seed, tensor name) only, never of the layout."""

from __future__ import annotations

import zlib

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.index import TensorEntry


def initial_value(entry: TensorEntry, *, seed: int, init: str = "normal", std: float = 0.02) -> torch.Tensor:
    """The full initial value of a logical tensor.

    Parameters follow their plan's ``init`` (normal with ``std``, ones, zeros). Optimizer state is random too
    (``exp_avg_sq`` non-negative), so every tensor of a test checkpoint is distinct; ``master`` is the fp32 copy of
    the parameter it belongs to, as a ZeRO-1 optimizer keeps it.
    """
    dtype = dtypes.to_torch(entry.dtype)
    if entry.role == "master":
        param = TensorEntry(name=entry.param, shape=entry.shape, dtype="float32", role="param", param=entry.param)
        return initial_value(param, seed=seed, init=init, std=std)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(entry.name.encode())) % (2**63))
    if entry.role == "param" and init in ("ones", "zeros"):
        # Perturb around the nominal value so that tests can tell every element apart.
        base = 1.0 if init == "ones" else 0.0
        noise = torch.randn(entry.shape, generator=g) * 0.01
        return (base + noise).to(dtype)
    values = torch.randn(entry.shape, generator=g) * std
    if entry.role == "exp_avg_sq":
        values = values.square()
    return values.to(dtype)
