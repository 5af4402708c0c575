"""moeckpt: save, reshard and restore Mixture-of-Experts training checkpoints.

The library API, in the conventions of ``torch.distributed.checkpoint``:

* :func:`save` / :func:`async_save` / :func:`load`: a state dict of DTensors (any mesh and placements), tensors
  and JSON values, saved collectively as a moeckpt checkpoint and loaded in place into any other mesh;
* :class:`Checkpointer`: a run directory of step checkpoints (newest committed, retention, damaged ones set
  aside, async saves);
* :mod:`moeckpt.dcp`: a ``StorageWriter`` / ``StorageReader`` pair, so ``dcp.save`` / ``dcp.load`` read and
  write the moeckpt format;
* :class:`CheckpointReader` and :func:`verify` for reading and checking any checkpoint, and the typed errors.

See ``docs/library.md``.
"""

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import (
    CheckpointIndexError,
    ChecksumMismatchError,
    DataFileError,
    DestinationNotEmptyError,
    LayoutError,
    MoeckptError,
    NotCommittedError,
    StorageError,
    UnsafePathError,
    UnsupportedVersionError,
)
from moeckpt.reshard.checkpointer import Checkpointer
from moeckpt.reshard.commit import SaveFailedError
from moeckpt.reshard.library import AsyncSave, SaveStats, async_save, load, save
from moeckpt.reshard.load import LoadStats
from moeckpt.reshard.state_dict import StateDictError

from .verification import verify

__all__ = [
    "AsyncSave",
    "CheckpointIndexError",
    "CheckpointReader",
    "Checkpointer",
    "ChecksumMismatchError",
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
    "load",
    "save",
    "verify",
]
