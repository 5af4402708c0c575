"""moeckpt: save, reshard and restore Mixture-of-Experts training checkpoints.

The library API, in the conventions of ``torch.distributed.checkpoint``:

* :func:`save` / :func:`async_save` / :func:`load`: a state dict of DTensors (any mesh and placements), tensors
  and JSON values, saved collectively as a moeckpt checkpoint and loaded in place into any other mesh;
* :class:`Checkpointer`: a run directory of step checkpoints (newest committed, retention, damaged ones set
  aside, async saves);
* :mod:`moeckpt.dcp`: a ``StorageWriter`` / ``StorageReader`` pair, so ``dcp.save`` / ``dcp.load`` read and
  write the moeckpt format;
* :func:`consolidate`: any checkpoint's tensors, whole, as Hugging Face sharded safetensors (no model plan);
* :class:`CheckpointReader` and :func:`verify` for reading and checking any checkpoint, and the typed errors.

See ``docs/library.md``. The names are imported on first use, so ``import moeckpt`` (and the command line, which
imports this package first) does not load torch before it needs to.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: every public name and the module that defines it.
_EXPORTS = {
    "AsyncSave": "moeckpt.library.save_load",
    "SaveStats": "moeckpt.library.save_load",
    "async_save": "moeckpt.library.save_load",
    "load": "moeckpt.library.save_load",
    "save": "moeckpt.library.save_load",
    "Checkpointer": "moeckpt.library.checkpointer",
    "ConsolidateResult": "moeckpt.library.consolidate",
    "consolidate": "moeckpt.library.consolidate",
    "SaveFailedError": "moeckpt.reshard.save_protocol",
    "LoadStats": "moeckpt.reshard.load",
    "StateDictError": "moeckpt.formats.errors",
    "CheckpointReader": "moeckpt.formats.checkpoint",
    "verify": "moeckpt.verification",
    "ChecksumMismatchError": "moeckpt.formats.errors",
    "CheckpointIndexError": "moeckpt.formats.errors",
    "DataFileError": "moeckpt.formats.errors",
    "DestinationNotEmptyError": "moeckpt.formats.errors",
    "LayoutError": "moeckpt.formats.errors",
    "MoeckptError": "moeckpt.formats.errors",
    "NotCommittedError": "moeckpt.formats.errors",
    "StorageError": "moeckpt.formats.errors",
    "UnsafePathError": "moeckpt.formats.errors",
    "UnsupportedVersionError": "moeckpt.formats.errors",
}

__all__ = [
    "AsyncSave",
    "CheckpointIndexError",
    "CheckpointReader",
    "Checkpointer",
    "ChecksumMismatchError",
    "ConsolidateResult",
    "DataFileError",
    "DestinationNotEmptyError",
    "LayoutError",
    "LoadStats",
    "MoeckptError",
    "NotCommittedError",
    "SaveFailedError",
    "SaveStats",
    "StateDictError",
    "StorageError",
    "UnsafePathError",
    "UnsupportedVersionError",
    "async_save",
    "consolidate",
    "load",
    "save",
    "verify",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moeckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and editors: the same names, imported eagerly
    from moeckpt.formats.checkpoint import CheckpointReader
    from moeckpt.formats.errors import (
        CheckpointIndexError,
        ChecksumMismatchError,
        DataFileError,
        DestinationNotEmptyError,
        LayoutError,
        MoeckptError,
        NotCommittedError,
        StateDictError,
        StorageError,
        UnsafePathError,
        UnsupportedVersionError,
    )
    from moeckpt.library.checkpointer import Checkpointer
    from moeckpt.library.consolidate import ConsolidateResult, consolidate
    from moeckpt.library.save_load import AsyncSave, SaveStats, async_save, load, save
    from moeckpt.reshard.load import LoadStats
    from moeckpt.reshard.save_protocol import SaveFailedError
    from moeckpt.verification import verify
