"""The safetensors file layout moeckpt writes: piece keys ``tensor@offsets``, one file name per writer, and the
header (length prefix, JSON document, block checksums of every piece in ``__metadata__``), sized before the pieces
are hashed so that a writer can put it in front of data it streams.

Byte-identical to the reference encoding (:func:`~.safetensors_write.encode`), which ``tests/golden`` pins; the
reader (:mod:`.safetensors`) parses what these functions write.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

from .. import dtypes
from ..box import Box
from ..checksum import checksum
from ..errors import DataFileError
from ..index import TensorEntry
from ..pieces import CHECKSUM_BLOCK_BYTES
from ..slices import BLOCK_SUFFIX, SLICES_SUFFIX, SliceGeometry, piece_geometry, piece_row_block, slice_widths

NAME = "safetensors"
#: header size limit, as in the safetensors reference implementation (100 MB): refuses hostile lengths early.
MAX_HEADER_BYTES = 100_000_000
META_VERSION_KEY = "moeckpt.format_version"
META_BLOCK_KEY = "moeckpt.checksum_block_bytes"
#: the data-file version of a file holding a sliced piece (format version 5); every other file says "1".
SLICED_DATA_VERSION = "2"


def piece_key(tensor: str, box: Box) -> str:
    """The key of a stored piece: ``<tensor>@<o0>,<o1>,...`` (its box's offsets; the shape is the entry's)."""
    return f"{tensor}@{','.join(str(o) for o in box.offsets)}"


def parse_piece_key(key: str) -> tuple[str, tuple[int, ...]]:
    """The tensor name and box offsets of a key :func:`piece_key` wrote; ``ValueError`` for another."""
    tensor, sep, offs = key.rpartition("@")
    if not sep or not tensor:
        raise ValueError(f"key {key!r} is not '<tensor>@<offsets>'")
    offsets = tuple(int(o) for o in offs.split(",")) if offs else ()
    return tensor, offsets


def file_name(writer: int) -> str:
    """The file a writer stores its pieces in: ``rank-NNNNN.safetensors``."""
    return f"rank-{writer:05d}.safetensors"


#: a placeholder of the exact width of a checksum, so a header can be sized before its pieces are hashed.
CHECKSUM_PLACEHOLDER = checksum(b"")


def header_bytes(layout: Sequence[tuple[str, Box, Sequence[str]]], tensors: dict[str, TensorEntry]) -> bytes:
    """The header (length prefix included) of a file holding pieces ``(tensor, box, block checksums)`` in order.

    Byte-identical to what :func:`~.safetensors_write.encode` writes for the same pieces; empty boxes are skipped as there.
    """
    return dump_header(header_doc(layout, tensors))


def header_doc(layout: Sequence[tuple[str, Box, Sequence[str]]], tensors: dict[str, TensorEntry]) -> dict:
    """The header as a JSON document; the writers fill in the checksums of ``__metadata__`` afterwards."""
    header: dict[str, object] = {}
    meta = {META_VERSION_KEY: "1", META_BLOCK_KEY: str(CHECKSUM_BLOCK_BYTES)}
    offset = 0
    for tensor, box, sums in layout:
        if box.is_empty():
            continue
        entry = tensors[tensor]
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        key = piece_key(tensor, box)
        header[key] = {
            "dtype": dtypes.to_safetensors(entry.dtype),
            "shape": list(box.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        meta[key] = ",".join(sums)
        sliced = slice_widths(entry.shape, entry.sharding, box)
        if sliced is not None:  # version 5: the piece's checksums follow its tensor's TP split
            meta[key + SLICES_SUFFIX] = f"{sliced[0]}:{','.join(str(w) for w in sliced[1])}"
            meta[META_VERSION_KEY] = SLICED_DATA_VERSION
        row_block = piece_block(box, entry)
        if row_block != CHECKSUM_BLOCK_BYTES:  # version 5: blocks that end at the TP split's rows
            meta[key + BLOCK_SUFFIX] = str(row_block)
            meta[META_VERSION_KEY] = SLICED_DATA_VERSION
        offset += nbytes
    return {"__metadata__": meta, **header}


def dump_header(doc: dict) -> bytes:
    """The header bytes of a document: its length (little-endian u64), then compact JSON padded to 8 bytes."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data start to 8 bytes, as the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw


def final_header(
    doc: dict, keys: Sequence[str], sums: Sequence[Sequence[str]], placeholder: bytes | None = None, where: str = ""
) -> bytes:
    """The header with the pieces' block checksums filled in; the same length as ``placeholder`` when given (the
    header is written over it)."""
    for key, piece_sums in zip(keys, sums):
        doc["__metadata__"][key] = ",".join(piece_sums)
    head = dump_header(doc)
    if placeholder is not None and len(head) != len(placeholder):
        raise DataFileError(
            f"{where}: header length changed from {len(placeholder)} to {len(head)} bytes after hashing; the checksum "
            "algorithm must produce fixed-length digests"
        )
    return head


def block_count(box: Box, entry: TensorEntry) -> int:
    """How many checksums the bytes of ``box`` of ``entry`` have: blocks (at least one: an empty piece has one),
    or for a sliced piece one per slice and row group."""
    geom = slicing(box, entry)
    if geom is not None:
        return geom.count
    return max(1, -(-box.numel * dtypes.itemsize(entry.dtype) // piece_block(box, entry)))


def piece_block(box: Box, entry: TensorEntry) -> int:
    """The checksum block size of the piece ``box`` of ``entry``: the file's, or for a piece that TP cuts along
    dimension 0 one whose blocks end at the cuts (version 5)."""
    b = piece_row_block(entry.shape, entry.sharding, box, dtypes.itemsize(entry.dtype), CHECKSUM_BLOCK_BYTES)
    return CHECKSUM_BLOCK_BYTES if b is None else b


def slicing(box: Box, entry: TensorEntry) -> SliceGeometry | None:
    """The checksum slices a writer gives the piece ``box`` of ``entry`` (version 5), or None (version 1's blocks)."""
    return piece_geometry(entry.shape, entry.sharding, box, entry.dtype, CHECKSUM_BLOCK_BYTES)
