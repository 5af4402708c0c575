"""The dtype names used in the index, their torch and safetensors equivalents, and the short names a command line
takes for them (``--dtype bf16``): the one home of dtype names."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from .errors import CheckpointIndexError

if TYPE_CHECKING:
    import torch

#: index dtype name (torch's own name for it) -> (safetensors dtype code, bytes per element). torch is imported by
#: the first call that needs a torch dtype, not with this module: reading an index or a header needs only names, and
#: an export that moves bytes need not pay torch's import (docs/benchmarks/README.md, the families benchmark).
_DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "bool": ("BOOL", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "complex64": ("C64", 8),
    # safetensors (0.8) has no code for complex128; moeckpt's readers take C128 (docs/format.md)
    "complex128": ("C128", 16),
}

#: the dtypes format version 3 added (``dcp.save`` of any state dict); every other dtype is in every version.
_VERSION_3 = frozenset({"uint16", "uint32", "uint64", "complex64", "complex128"})

_BY_ST = {v[0]: k for k, v in _DTYPES.items()}

DTYPE_NAMES = tuple(_DTYPES)

#: short names of parameter dtypes, as commands and the trainer's config take them, by the index name they stand for.
SHORT_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def short_names(*shorts: str) -> dict[str, str]:
    """The short names ``shorts`` (all of :data:`SHORT_NAMES` when none are given) with the index names they stand
    for, in the order given: what a command that takes only some of them offers."""
    return {s: SHORT_NAMES[s] for s in (shorts or SHORT_NAMES)}


def check_dtype_name(name: object, where: str) -> str:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointIndexError(f"{where}: unknown dtype {name!r}; known: {', '.join(DTYPE_NAMES)}")
    return name


def since_version(name: str) -> int:
    """The first format version whose indexes may hold dtype ``name``."""
    return 3 if name in _VERSION_3 else 1


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """Index name -> torch dtype and back, made on first use (whole, whichever thread asks first)."""
    import torch

    to = {name: getattr(torch, name) for name in _DTYPES}
    return to, {d: name for name, d in to.items()}


def to_torch(name: str) -> torch.dtype:
    return _torch_tables()[0][name]


def from_torch(dtype: torch.dtype) -> str:
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored; supported: {', '.join(DTYPE_NAMES)}") from None


def to_safetensors(name: str) -> str:
    return _DTYPES[name][0]


def from_safetensors(code: object) -> str | None:
    return _BY_ST.get(code) if isinstance(code, str) else None


def itemsize(name: str) -> int:
    return _DTYPES[name][1]
