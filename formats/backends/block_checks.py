"""Checks of the checksum blocks of bytes read in several parts (a read straight into a destination, the bytes
around it in scratch), without joining the parts: flat blocks hashed across part edges, a sliced piece's row
groups (format version 5) where they landed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import ChecksumMismatchError
from ..pieces import PieceRef, verify_blocks
from ..slices import SliceHasher
from .piece_stream import BlockHasher


def slices_match(parts: Sequence[memoryview], first_group: int, ref: PieceRef) -> bool:
    """Whether the row groups of sliced piece ``ref`` from ``first_group`` that ``parts`` hold, end to end, have
    their recorded checksums, hashed across the parts without joining them."""
    geom = ref.geometry
    if geom is None:
        return False
    hasher = SliceHasher(geom)
    for part in parts:
        hasher.update(part)
    got = hasher.finish()
    slices = len(geom.cols) - 1
    groups = len(got) // slices
    if groups * slices != len(got) or first_group + groups > geom.groups:
        return False
    return all(
        got[j * groups + i] == ref.checksums[j * geom.groups + first_group + i]
        for j in range(slices)
        for i in range(groups)
    )


def verify_parts(parts: Sequence[memoryview], first_block: int, ref: PieceRef, where: str) -> None:
    """:func:`verify_blocks` over the concatenation of ``parts`` (whole blocks of ``ref`` from ``first_block``)
    without joining them: a block that spans two parts is hashed in two updates. A sliced piece's row groups
    (format version 5) are checked where they landed: rows that cross from one part into the next are hashed a
    fragment at a time (:class:`~moeckpt.formats.slices.SliceHasher`)."""
    if ref.geometry is not None:
        if len(parts) == 1:  # whole row groups read straight into one buffer (a load's usual part): no copy
            verify_blocks(parts[0], first_block, ref, where)
        elif not slices_match(parts, first_block, ref):  # checked again on a joined copy, which names the slice
            joined = np.concatenate([np.frombuffer(p, dtype=np.uint8) for p in parts] or [np.empty(0, np.uint8)])
            verify_blocks(joined.data, first_block, ref, where)
        return
    hasher = BlockHasher(ref.block_bytes)
    for part in parts:
        hasher.update(part)
    check_block_sums(hasher, parts, first_block, ref, where)


def check_block_sums(
    hasher: BlockHasher, parts: Sequence[memoryview], first_block: int, ref: PieceRef, where: str
) -> None:
    """Refuse bytes ``parts`` (whole blocks of ``ref`` from ``first_block``, all fed to ``hasher``) unless every
    block has its recorded checksum; the error names the first failing block."""
    if not any(len(p) for p in parts):
        return
    got = hasher.finish()
    if got != list(ref.checksums[first_block : first_block + len(got)]):
        verify_blocks(b"".join(bytes(p) for p in parts), first_block, ref, where)  # names the failing block
        raise ChecksumMismatchError(f"{where}: checksum mismatch in tensor {ref.tensor!r}; the file is corrupt")
