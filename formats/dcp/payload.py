"""Locating a tensor's bytes inside a DCP item record, without ``torch.load``.

``FileSystemWriter`` writes each tensor item as a ``torch.save`` of the chunk: an uncompressed zip holding
``data.pkl`` (a pickle that rebuilds the tensor from a storage) and ``data/<key>`` (the storage's raw bytes,
little-endian). Reading the zip's directory and parsing ``data.pkl`` with the restricted payload unpickler gives
the storage key, dtype, element offset, size and stride; the rows a reader needs are then plain byte ranges of the
``.distcp`` file, read straight into tensors. Every size is checked against the metadata (shape, dtype) and against
the record, so a truncated or inconsistent file is refused instead of read past. Items written raw (the
``SAFETENSORS`` serialization format) are recognised by their length: exactly the chunk's bytes.

Non-tensor values (``BytesStorageMetadata``: a ``torch.save`` of an int, a string, a small dict) are decoded with
``torch.load(weights_only=True)`` under a size limit, and kept only when they are plain JSON data.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

from moeckpt.formats.render import bounded_repr, bounded_text

from . import bounds
from . import unpickler as up
from .metadata import DcpFormatError, itemsize

#: bytes read at each end of a record to find its zip directory and ``data.pkl`` in one go (each is small).
PROBE_BYTES = 8192
#: a tensor item's ``data.pkl`` is a few hundred bytes; refuse anything much larger before parsing it.
MAX_PICKLE_BYTES = 64 * 1024
#: largest non-tensor value decoded (a ``torch.save`` of a step counter or a data loader position).
MAX_VALUE_BYTES = 1024 * 1024
#: most JSON nodes a decoded value may expand to (a pickle can share one list many times over).
MAX_VALUE_NODES = 100_000

_EOCD = b"PK\x05\x06"
_ZIP64_EOCD = b"PK\x06\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


@dataclass(frozen=True)
class ZipEntry:
    name: str
    method: int
    size: int
    compressed: int
    header: int  # offset of the local header in the record


#: ``read(lo, hi)`` returns bytes ``[lo, hi)`` of the record (record-relative offsets).
ReadRecord = Callable[[int, int], bytes]


def probe_ranges(length: int) -> list[tuple[int, int]]:
    """The record-relative ranges that locating a tensor in a record of ``length`` bytes reads first: its head
    (local headers, ``data.pkl``) and its tail (the zip directory); one range when the record is that short."""
    head, tail = (0, min(length, PROBE_BYTES)), (max(0, length - PROBE_BYTES), length)
    return [head] if head == tail else [head, tail]


def _zip_entries(read: ReadRecord, length: int, where: str) -> dict[str, ZipEntry]:
    tail_lo = max(0, length - PROBE_BYTES)
    tail = read(tail_lo, length)
    pos = tail.rfind(_EOCD)
    if pos < 0 or len(tail) - pos < 22:
        raise DcpFormatError(
            f"{where}: the item is not a torch.save archive (no zip directory at its end); "
            "the file is truncated or corrupt"
        )
    count, cd_size, cd_offset = struct.unpack("<HII", tail[pos + 10 : pos + 20])
    if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF or count == 0xFFFF:
        loc = tail.rfind(_ZIP64_LOCATOR, 0, pos)
        if loc < 0:
            raise DcpFormatError(f"{where}: zip64 archive without its locator; the file is corrupt")
        (z64,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        rec = (
            read(z64, z64 + 56)
            if not (tail_lo <= z64 and z64 + 56 <= length)
            else tail[z64 - tail_lo : z64 - tail_lo + 56]
        )
        if rec[:4] != _ZIP64_EOCD or len(rec) < 56:
            raise DcpFormatError(f"{where}: bad zip64 directory record; the file is corrupt")
        count, cd_size, cd_offset = struct.unpack("<QQQ", rec[32:56])
    if cd_offset + cd_size > length or count > 10_000:
        raise DcpFormatError(f"{where}: zip directory at {cd_offset}+{cd_size} lies outside the {length}-byte item")
    cd = (
        tail[cd_offset - tail_lo : cd_offset - tail_lo + cd_size]
        if cd_offset >= tail_lo
        else read(cd_offset, cd_offset + cd_size)
    )
    entries: dict[str, ZipEntry] = {}
    p = 0
    for _ in range(count):
        if cd[p : p + 4] != _CENTRAL or len(cd) < p + 46:
            raise DcpFormatError(f"{where}: damaged zip directory entry; the file is corrupt")
        (method,) = struct.unpack("<H", cd[p + 10 : p + 12])
        compressed, size = struct.unpack("<II", cd[p + 20 : p + 28])
        nlen, elen, clen = struct.unpack("<HHH", cd[p + 28 : p + 34])
        (header,) = struct.unpack("<I", cd[p + 42 : p + 46])
        name = cd[p + 46 : p + 46 + nlen].decode("utf-8", "replace")
        extra = cd[p + 46 + nlen : p + 46 + nlen + elen]
        if 0xFFFFFFFF in (compressed, size, header):
            size, compressed, header = _zip64_extra(extra, size, compressed, header, where)
        entries[name] = ZipEntry(name, method, size, compressed, header)
        p += 46 + nlen + elen + clen
    return entries


def _zip64_extra(extra: bytes, size: int, compressed: int, header: int, where: str) -> tuple[int, int, int]:
    q = 0
    while q + 4 <= len(extra):
        tag, n = struct.unpack("<HH", extra[q : q + 4])
        if tag == 1:
            vals = list(struct.unpack(f"<{n // 8}Q", extra[q + 4 : q + 4 + n - n % 8]))
            if size == 0xFFFFFFFF:
                size = vals.pop(0)
            if compressed == 0xFFFFFFFF:
                compressed = vals.pop(0)
            if header == 0xFFFFFFFF:
                header = vals.pop(0)
            return size, compressed, header
        q += 4 + n
    raise DcpFormatError(f"{where}: zip64 sizes missing from a directory entry; the file is corrupt")


def _data_start(read: ReadRecord, entry: ZipEntry, length: int, where: str) -> int:
    if entry.method != 0 or entry.compressed != entry.size:
        raise DcpFormatError(
            f"{where}: zip entry {bounded_text(entry.name)} is compressed; torch.save never compresses, so the "
            "item is not a torch.save archive"
        )
    local = read(entry.header, entry.header + 30)
    if local[:4] != _LOCAL or len(local) < 30:
        raise DcpFormatError(f"{where}: damaged local header of {bounded_text(entry.name)}; the file is corrupt")
    nlen, elen = struct.unpack("<HH", local[26:30])
    start = entry.header + 30 + nlen + elen
    if start + entry.size > length:
        raise DcpFormatError(
            f"{where}: {bounded_text(entry.name)} runs past the end of its {length}-byte item; the file is truncated"
        )
    return start


@dataclass(frozen=True)
class TensorLocation:
    """Where a chunk's elements are: bytes ``[start, start + nbytes)`` of the item record, C order."""

    start: int
    nbytes: int


def locate_tensor(read: ReadRecord, length: int, shape: tuple[int, ...], dtype: str, where: str) -> TensorLocation:
    """The chunk's data inside its record, checked against ``shape`` and ``dtype`` from the metadata."""
    nbytes = math.prod(shape) * itemsize(dtype)
    if length == nbytes:  # written raw (SerializationFormat.SAFETENSORS): a torch.save is always longer
        return TensorLocation(0, nbytes)
    entries = _zip_entries(read, length, where)
    pkl = [e for n, e in entries.items() if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise DcpFormatError(f"{where}: the archive holds {len(pkl)} data.pkl entries, not one")
    if pkl[0].size > MAX_PICKLE_BYTES:
        raise DcpFormatError(f"{where}: data.pkl is {pkl[0].size} bytes; a tensor item's is a few hundred")
    pstart = _data_start(read, pkl[0], length, where)
    prefix = pkl[0].name[: -len("data.pkl")]
    order = entries.get(prefix + "byteorder")
    if order is not None and order.size <= 16:
        bstart = _data_start(read, order, length, where)
        if read(bstart, bstart + order.size) != b"little":
            raise DcpFormatError(f"{where}: the tensor was saved big-endian; moeckpt reads little-endian data only")
    ref = up.load_payload_pickle(read(pstart, pstart + pkl[0].size), where)
    if not isinstance(ref, up.TensorRef):
        raise DcpFormatError(f"{where}: the item's pickle is not one tensor")
    storage = ref.storage
    if storage.dtype != dtype:
        raise DcpFormatError(f"{where}: the item holds {storage.dtype} data but the metadata says {dtype}")
    if tuple(ref.size) != tuple(shape):
        raise DcpFormatError(
            f"{where}: the item holds a tensor of shape {bounded_repr(list(ref.size))}, the metadata's chunk is "
            f"{list(shape)}"
        )
    if math.prod(shape) and not _is_contiguous(tuple(ref.stride), shape):
        raise DcpFormatError(
            f"{where}: the tensor was saved as a strided view (strides {bounded_repr(list(ref.stride))} for shape "
            f"{list(shape)}, "
            "e.g. a transposed weight); moeckpt streams C-contiguous items only: save .contiguous() tensors"
        )
    data = entries.get(f"{prefix}data/{storage.key}")
    if data is None:
        raise DcpFormatError(f"{where}: the archive lacks the storage record data/{bounded_text(storage.key)}")
    item = itemsize(dtype)
    if data.size != storage.numel * item or (ref.offset + math.prod(shape)) > storage.numel:
        raise DcpFormatError(
            f"{where}: storage data/{bounded_text(storage.key)} is {data.size} bytes, too small for the tensor "
            "it holds; the file is corrupt"
        )
    start = _data_start(read, data, length, where)
    return TensorLocation(start + ref.offset * item, nbytes)


def _is_contiguous(stride: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """C order, ignoring the strides of dims of size 1 (a clone of a slice keeps its parent's stride there)."""
    if len(stride) != len(shape):
        return False
    step = 1
    for st, sz in zip(reversed(stride), reversed(shape)):
        if sz != 1 and st != step:
            return False
        step *= sz
    return True


def decode_value(data: bytes, where: str) -> object:
    """A non-tensor item's value as JSON data (ints, floats, strings, lists, dicts; 0-d tensors as numbers).

    Decoded by ``torch.load(weights_only=True)``, torch's own restricted unpickler; refused when larger than
    ``MAX_VALUE_BYTES`` or when it expands past ``MAX_VALUE_NODES`` (a pickle that shares one list many times).
    Returns :data:`NOT_JSON` for values that are not plain data.
    """
    if len(data) > MAX_VALUE_BYTES:
        raise DcpFormatError(f"{where}: a {len(data)}-byte value is larger than moeckpt decodes ({MAX_VALUE_BYTES})")
    _check_value_pickle(data, where)
    import torch

    try:
        value = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - weights_only refusals and corrupt archives raise many types
        raise DcpFormatError(f"{where}: value is not a readable weights-only torch.save ({_one_line(e)})") from None
    budget = [MAX_VALUE_NODES]
    return _jsonable(value, budget, where)


def _check_value_pickle(data: bytes, where: str) -> None:
    """Bound the pickle of a value's archive (:func:`~moeckpt.formats.dcp.bounds.scan`) before ``torch.load``
    runs it: torch's restricted unpickler admits few names, but it hashes what it is given as dictionary keys (a
    tuple nested deeply crashes it, a shared one takes forever) and sizes nothing."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pickles = [i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
    except (zipfile.BadZipFile, ValueError, OSError):
        raise DcpFormatError(f"{where}: the value is not a torch.save archive; the file is corrupt") from None
    if len(pickles) != 1 or pickles[0].compress_type != zipfile.ZIP_STORED or pickles[0].file_size > len(data):
        raise DcpFormatError(f"{where}: the value's archive does not hold one stored data.pkl; the file is corrupt")
    try:
        pickle_bytes = archive.read(pickles[0])
    except (zipfile.BadZipFile, ValueError, OSError):
        raise DcpFormatError(f"{where}: the value's data.pkl cannot be read; the file is corrupt") from None
    bounds.scan_bytes(pickle_bytes, where, persistent=True)


class _NotJson:
    def __repr__(self) -> str:
        return "NOT_JSON"


NOT_JSON = _NotJson()


def _jsonable(value: object, budget: list[int], where: str, depth: int = 0) -> object:
    budget[0] -= 1
    if budget[0] < 0 or depth > 64:
        raise DcpFormatError(f"{where}: value expands past {MAX_VALUE_NODES} elements; refusing it (a pickle bomb?)")
    import torch

    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else NOT_JSON
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0:
            return _jsonable(value.item(), budget, where, depth + 1)
        return NOT_JSON
    if isinstance(value, (list, tuple)):
        out = [_jsonable(v, budget, where, depth + 1) for v in value]
        return NOT_JSON if any(v is NOT_JSON for v in out) else out
    if isinstance(value, dict):
        items = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                return NOT_JSON
            items[str(k)] = _jsonable(v, budget, where, depth + 1)
        return NOT_JSON if any(v is NOT_JSON for v in items.values()) else items
    return NOT_JSON


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200]
