"""Reading torch DCP checkpoints (``torch.distributed.checkpoint``: ``.metadata`` + ``__R_N.distcp``) safely.

Knows logical tensors and chunk boxes only, nothing of models: :mod:`moeckpt.trainer.interop` maps a framework's
names onto a bundled architecture. Nothing in a DCP checkpoint is ever unpickled by ``pickle`` itself:
``.metadata`` and each tensor item's ``data.pkl`` go through the restricted unpicklers of
:mod:`~moeckpt.formats.dcp.unpickler`, non-tensor values through ``torch.load(weights_only=True)``.
"""

from .metadata import (
    METADATA_NAME,
    DcpChunk,
    DcpFormatError,
    DcpMetadata,
    DcpTensor,
    Record,
    parse_metadata,
)
from .reader import DcpCheckpoint, StoredChunk, open_dcp
from .unpickler import UnsafePickleError

__all__ = [
    "METADATA_NAME",
    "DcpCheckpoint",
    "DcpChunk",
    "DcpFormatError",
    "DcpMetadata",
    "DcpTensor",
    "Record",
    "StoredChunk",
    "UnsafePickleError",
    "open_dcp",
    "parse_metadata",
]
