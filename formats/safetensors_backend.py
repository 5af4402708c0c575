"""The safetensors backend: one standard ``.safetensors`` file per writing rank.

Each stored piece is one safetensors entry whose key names the logical tensor and the box offsets,
``"<tensor>@<o0>,<o1>,..."`` (its shape is the entry's shape). The header's ``__metadata__`` carries the
block checksums of every piece, so a reader verifies exactly the bytes it reads. Any safetensors reader can
open the files; reads here go by byte range (header first, then the bytes of the pieces needed).
"""

from __future__ import annotations

import json
import struct
from typing import Iterable, Sequence

import torch

from . import dtypes
from .box import Box
from .checksum import checksum
from .errors import DataFileError
from .index import FileEntry, TensorEntry
from .pieces import CHECKSUM_BLOCK_BYTES, Piece, PieceRef, block_checksums, tensor_bytes, verify_blocks
from .storage import Storage

NAME = "safetensors"
#: header size limit, as in the safetensors reference implementation (100 MB): refuses hostile lengths early.
MAX_HEADER_BYTES = 100_000_000
META_VERSION_KEY = "moeckpt.format_version"
META_BLOCK_KEY = "moeckpt.checksum_block_bytes"


def piece_key(tensor: str, box: Box) -> str:
    return f"{tensor}@{','.join(str(o) for o in box.offsets)}"


def parse_piece_key(key: str) -> tuple[str, tuple[int, ...]]:
    tensor, sep, offs = key.rpartition("@")
    if not sep or not tensor:
        raise ValueError(f"key {key!r} is not '<tensor>@<offsets>'")
    offsets = tuple(int(o) for o in offs.split(",")) if offs else ()
    return tensor, offsets


def file_name(writer: int) -> str:
    return f"rank-{writer:05d}.safetensors"


def encode(pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> tuple[bytes, list[memoryview]]:
    """The header bytes (length prefix included) and the data buffers of a file holding ``pieces``."""
    header: dict[str, object] = {}
    meta = {META_VERSION_KEY: "1", META_BLOCK_KEY: str(CHECKSUM_BLOCK_BYTES)}
    buffers: list[memoryview] = []
    offset = 0
    for p in pieces:
        entry = tensors[p.tensor]
        if dtypes.from_torch(p.data.dtype) != entry.dtype:
            raise ValueError(f"piece of {p.tensor!r} has dtype {p.data.dtype}, the index says {entry.dtype}")
        if p.box.is_empty():
            continue  # empty ZeRO parts are legal in a layout and never stored
        data = tensor_bytes(p.data)
        key = piece_key(p.tensor, p.box)
        header[key] = {
            "dtype": dtypes.to_safetensors(entry.dtype),
            "shape": list(p.box.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        meta[key] = ",".join(block_checksums(data))
        buffers.append(data)
        offset += len(data)
    doc = {"__metadata__": meta, **header}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data start to 8 bytes, as the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw, buffers


def write_file(storage: Storage, relpath: str, pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> FileEntry:
    """Write (and on local disk fsync) one data file; returns its index entry."""
    head, buffers = encode(pieces, tensors)
    size = len(head)
    with storage.open_write(relpath) as f:
        f.write(head)
        for b in buffers:
            f.write(b)
            size += len(b)
    return FileEntry(path=relpath, size=size, checksum=checksum(head))


def read_header(storage: Storage, entry: FileEntry, tensors: dict[str, TensorEntry]) -> list[PieceRef]:
    """Read and validate one file's header against the index; returns its pieces."""
    where = storage.path(entry.path)
    try:
        actual = storage.size(entry.path)
    except FileNotFoundError:
        raise DataFileError(f"{where}: data file is missing (listed in the index); the checkpoint is incomplete") from None
    if actual != entry.size:
        raise DataFileError(f"{where}: size is {actual} bytes, the index says {entry.size}: the file is truncated or replaced")
    if actual < 8:
        raise DataFileError(f"{where}: too short to be a safetensors file")
    first = bytes(storage.read_range(entry.path, 0, min(actual, 8 + 64 * 1024)))
    (hlen,) = struct.unpack("<Q", first[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > actual:
        raise DataFileError(f"{where}: header length {hlen} is impossible for a {actual}-byte file")
    head = first[: 8 + hlen] if 8 + hlen <= len(first) else first + bytes(storage.read_range(entry.path, len(first), 8 + hlen))
    if checksum(head) != entry.checksum:
        raise DataFileError(f"{where}: header checksum differs from the index: the header is corrupt")
    try:
        doc = json.loads(head[8:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{where}: header is not valid JSON ({e})") from None
    return _pieces_from_header(doc, 8 + hlen, actual, where, entry.path, tensors)


def _pieces_from_header(
    doc: object, data_start: int, file_size: int, where: str, relpath: str, tensors: dict[str, TensorEntry]
) -> list[PieceRef]:
    if not isinstance(doc, dict) or not isinstance(doc.get("__metadata__"), dict):
        raise DataFileError(f"{where}: header has no __metadata__ with the piece checksums")
    meta = doc["__metadata__"]
    try:
        block = int(meta.get(META_BLOCK_KEY, ""))
    except ValueError:
        raise DataFileError(f"{where}: header lacks {META_BLOCK_KEY}") from None
    if block <= 0:
        raise DataFileError(f"{where}: checksum block size {block} must be positive")
    refs: list[PieceRef] = []
    expected_offset = 0
    for key, info in doc.items():
        if key == "__metadata__":
            continue
        try:
            tensor, offsets = parse_piece_key(key)
        except ValueError as e:
            raise DataFileError(f"{where}: {e}") from None
        entry = tensors.get(tensor)
        if entry is None:
            raise DataFileError(f"{where}: piece {key!r} names tensor {tensor!r}, which the index does not list")
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or not isinstance(
            info.get("data_offsets"), list
        ):
            raise DataFileError(f"{where}: entry {key!r} needs 'dtype', 'shape' and 'data_offsets'")
        if dtypes.from_safetensors(info.get("dtype")) != entry.dtype:
            raise DataFileError(f"{where}: piece {key!r} has dtype {info.get('dtype')!r}, the index says {entry.dtype}")
        try:
            box = Box(offsets, tuple(int(s) for s in info["shape"]))
            start, end = (int(v) for v in info["data_offsets"])
        except (ValueError, TypeError):
            raise DataFileError(f"{where}: piece {key!r} has a malformed shape or data_offsets") from None
        if not box.within(entry.shape):
            raise DataFileError(f"{where}: piece {key!r} box {box.to_json()} lies outside tensor shape {list(entry.shape)}")
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        if start != expected_offset or end - start != nbytes:
            raise DataFileError(f"{where}: piece {key!r} data_offsets {[start, end]} do not match its shape and order")
        expected_offset = end
        sums = meta.get(key)
        if not isinstance(sums, str):
            raise DataFileError(f"{where}: piece {key!r} has no checksum in __metadata__")
        checks = tuple(sums.split(","))
        if len(checks) != max(1, -(-nbytes // block)):
            raise DataFileError(f"{where}: piece {key!r} lists {len(checks)} block checksums for {nbytes} bytes")
        refs.append(PieceRef(tensor, box, entry.dtype, relpath, data_start + start, nbytes, checks, block))
    if data_start + expected_offset != file_size:
        raise DataFileError(f"{where}: header describes {data_start + expected_offset} bytes but the file has {file_size}")
    return refs


def read_piece(storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a piece, or only rows ``[r0, r1)`` of its dim 0 (in piece coordinates), verifying what is read.

    The read is widened to whole checksum blocks, so every byte returned was checked.
    """
    where = storage.path(ref.file)
    shape = list(ref.box.shape)
    item = dtypes.itemsize(ref.dtype)
    if rows is None or not shape:
        r0, r1 = 0, shape[0] if shape else 1
    else:
        r0, r1 = rows
    row_bytes = (ref.nbytes // shape[0]) if shape and shape[0] else ref.nbytes
    lo, hi = r0 * row_bytes, r1 * row_bytes
    if not shape:
        lo, hi = 0, ref.nbytes
    b0 = lo // ref.block_bytes
    b1 = -(-hi // ref.block_bytes) if hi > 0 else 1
    read_lo, read_hi = b0 * ref.block_bytes, min(b1 * ref.block_bytes, ref.nbytes)
    buf = storage.read_range(ref.file, ref.start + read_lo, ref.start + read_hi)
    if len(buf) != read_hi - read_lo:
        raise DataFileError(f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated")
    verify_blocks(buf, b0, ref, where)
    out_shape = ([r1 - r0] + shape[1:]) if shape else []
    if hi == lo:
        return torch.empty(out_shape, dtype=dtypes.to_torch(ref.dtype))
    flat = torch.frombuffer(buf, dtype=torch.uint8, offset=lo - read_lo, count=hi - lo)
    del item
    return flat.view(dtypes.to_torch(ref.dtype)).reshape(out_shape)


def list_pieces(storage: Storage, files: Iterable[FileEntry], tensors: dict[str, TensorEntry]) -> list[PieceRef]:
    out: list[PieceRef] = []
    for f in files:
        out.extend(read_header(storage, f, tensors))
    return out
