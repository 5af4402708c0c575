"""Reading a safetensors file's header: checked against the index (size, header checksum), then every piece's key,
dtype, box, data offsets and checksums (blocks, a row block, or the slices of format version 5) parsed into
:class:`~moeckpt.formats.pieces.PieceRef` values. The rest of the backend is :mod:`.safetensors`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

from .. import dtypes
from ..box import Box
from ..checksum import checksum
from ..errors import DataFileError
from ..index import FileEntry, TensorEntry
from ..pieces import PieceRef
from ..slices import BLOCK_SUFFIX, SLICES_SUFFIX
from ..storage import Storage
from .safetensors_header import MAX_HEADER_BYTES, META_BLOCK_KEY, parse_piece_key


def read_header(
    storage: Storage, entry: FileEntry, tensors: dict[str, TensorEntry], *, slices: bool = True
) -> list[PieceRef]:
    """Read and validate one file's header against the index; returns its pieces. Without ``slices`` (an index
    of a version before 5), a piece with checksum slices or a row block is refused."""
    where = storage.path(entry.path)
    try:
        actual = storage.size(entry.path)
    except FileNotFoundError:
        raise DataFileError(
            f"{where}: data file is missing (listed in the index); the checkpoint is incomplete"
        ) from None
    if actual != entry.size:
        raise DataFileError(
            f"{where}: size is {actual} bytes, the index says {entry.size}: the file is truncated or replaced"
        )
    if actual < 8:
        raise DataFileError(f"{where}: too short to be a safetensors file")
    first = bytes(storage.read_range(entry.path, 0, min(actual, 8 + 64 * 1024)))
    (hlen,) = struct.unpack("<Q", first[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > actual:
        raise DataFileError(f"{where}: header length {hlen} is impossible for a {actual}-byte file")
    head = (
        first[: 8 + hlen]
        if 8 + hlen <= len(first)
        else first + bytes(storage.read_range(entry.path, len(first), 8 + hlen))
    )
    if checksum(head) != entry.checksum:
        raise DataFileError(f"{where}: header checksum differs from the index: the header is corrupt")
    try:
        doc = json.loads(head[8:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{where}: header is not valid JSON ({e})") from None
    refs = _pieces_from_header(doc, 8 + hlen, actual, where, entry.path, tensors)
    if not slices and any(r.slices or r.block_bytes != block_size(doc) for r in refs):
        raise DataFileError(
            f"{where}: a piece has checksum slices or a row block (format version 5), but the index says an "
            "earlier version: the index or the file is not the one written with it"
        )
    return refs


def block_size(doc: dict) -> int:
    """The checksum block size a (validated) header records for its file."""
    return int(doc["__metadata__"][META_BLOCK_KEY])


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
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("shape"), list)
            or not isinstance(info.get("data_offsets"), list)
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
            raise DataFileError(
                f"{where}: piece {key!r} box {box.to_json()} lies outside tensor shape {list(entry.shape)}"
            )
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        if start != expected_offset or end - start != nbytes:
            raise DataFileError(f"{where}: piece {key!r} data_offsets {[start, end]} do not match its shape and order")
        expected_offset = end
        sums = meta.get(key)
        if not isinstance(sums, str):
            raise DataFileError(f"{where}: piece {key!r} has no checksum in __metadata__")
        checks = tuple(sums.split(","))
        dim, widths = _slices_of(meta.get(key + SLICES_SUFFIX), box, where, key)
        piece_block = _block_of(meta.get(key + BLOCK_SUFFIX), block, where, key)
        ref = PieceRef(
            tensor,
            box,
            entry.dtype,
            relpath,
            data_start + start,
            nbytes,
            checks,
            piece_block,
            slice_dim=dim,
            slices=widths,
        )
        want = max(1, -(-nbytes // piece_block)) if ref.geometry is None else ref.geometry.count
        if len(checks) != want:
            raise DataFileError(f"{where}: piece {key!r} lists {len(checks)} block checksums for {nbytes} bytes")
        refs.append(ref)
    if data_start + expected_offset != file_size:
        raise DataFileError(
            f"{where}: header describes {data_start + expected_offset} bytes but the file has {file_size}"
        )
    return refs


def _block_of(value: object, block: int, where: str, key: str) -> int:
    """A piece's own checksum block size (``"<bytes>"``, format version 5), or the file's ``block``."""
    if value is None:
        return block
    if not isinstance(value, str) or not value.isdigit() or not 0 < int(value) <= block:
        raise DataFileError(f"{where}: piece {key!r} has a malformed checksum block size {value!r}")
    return int(value)


def _slices_of(value: object, box: Box, where: str, key: str) -> tuple[int, tuple[int, ...]]:
    """The checksum slices a header records for a piece (``"<dim>:<w0>,<w1>,..."``, format version 5), or
    ``(0, ())`` where it records none."""
    if value is None:
        return 0, ()
    try:
        dim_text, _, widths_text = value.partition(":") if isinstance(value, str) else ("", "", "")
        dim, widths = int(dim_text), tuple(int(w) for w in widths_text.split(","))
    except ValueError:
        dim, widths = -1, ()
    if not 1 <= dim < box.ndim or len(widths) < 2 or min(widths) <= 0 or sum(widths) != box.shape[dim]:
        raise DataFileError(
            f"{where}: piece {key!r} has malformed checksum slices {value!r} (want '<dim>:<w0>,<w1>,...' along a "
            f"dimension >= 1 adding up to the box's)"
        )
    return dim, widths


def list_pieces(
    storage: Storage, files: Iterable[FileEntry], tensors: dict[str, TensorEntry], *, slices: bool = True
) -> list[PieceRef]:
    out: list[PieceRef] = []
    for f in files:
        out.extend(read_header(storage, f, tensors, slices=slices))
    return out
