"""``moeckpt.verify``: check a checkpoint (or a run's newest) end to end, from its path."""

from __future__ import annotations

import os

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.checkpoint import verify as _verify_reader

__all__ = ["verify"]


def verify(path: str | os.PathLike[str] | CheckpointReader) -> list[str]:
    """Every problem of the checkpoint at ``path`` (every data file, piece checksum and tensor cover checked);
    an empty list when it is sound. A missing or uncommitted checkpoint raises ``NotCommittedError``."""
    reader = path if isinstance(path, CheckpointReader) else CheckpointReader(path)
    return _verify_reader(reader)
