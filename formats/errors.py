"""Typed errors of the format layer.

Each error is also the builtin a caller would naturally catch (``ValueError``, ``FileNotFoundError``, ...), and
its message says what went wrong, where, and how to fix it. The CLI turns every :class:`MoeckptError` into one
line on stderr and exit code 2 (bad input) or 1 (a failed check).
"""

from __future__ import annotations


class MoeckptError(Exception):
    """Base of every error moeckpt raises on purpose."""

    #: exit code the CLI uses for this error: 2 = bad input, 1 = a check failed.
    exit_code = 2


class CheckpointIndexError(MoeckptError, ValueError):
    """The checkpoint index (``moeckpt.json``) is missing a field, malformed or inconsistent."""


class UnsupportedVersionError(MoeckptError, ValueError):
    """The index was written by a newer (or unknown) format version."""


class UnsafePathError(MoeckptError, ValueError):
    """A path recorded in a checkpoint points outside its directory."""


class NotCommittedError(MoeckptError, FileNotFoundError):
    """No committed checkpoint at a location (no index, or only an unfinished save)."""


class DataFileError(MoeckptError, ValueError):
    """A data file is missing, truncated, or its header does not match the index."""


class ChecksumMismatchError(MoeckptError, ValueError):
    """The bytes of a piece do not hash to the checksum recorded beside them."""

    exit_code = 1


class LayoutError(MoeckptError, ValueError):
    """A parallel layout the model (or the checkpoint) cannot take."""


class StorageError(MoeckptError, OSError):
    """The storage refused an operation (permission, missing bucket, full disk, ...)."""


class DestinationNotEmptyError(MoeckptError, FileExistsError):
    """The output location already holds files; pass ``--overwrite`` to replace them."""


class StateDictError(MoeckptError, ValueError):
    """A state dict that cannot be saved or loaded as given (a leaf type, a key, a shape or dtype mismatch)."""
