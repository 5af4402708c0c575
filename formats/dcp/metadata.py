"""A torch DCP checkpoint's ``.metadata``, read without running it: logical tensors, their chunks, and where each
chunk's bytes are.

DCP's ``Metadata`` maps every state-dict key (flattened, dotted) to either a ``TensorStorageMetadata`` (global
size, dtype, the chunks that were written: offsets and sizes) or a ``BytesStorageMetadata`` (a ``torch.save`` of a
non-tensor value), and ``storage_data`` maps each item (key plus chunk offsets) to a ``_StorageInfo``: the file
(relative path), the byte offset and the length of its record. This module turns the restricted unpickler's
stand-ins into :class:`DcpMetadata` and checks everything a reader relies on: every path stays inside the
directory, every chunk lies inside its tensor and has a storage record, the chunks of a tensor cover it exactly
once, no transform (compression) is applied.

Everything here came from a foreign file, so each value is type-checked before it is used, every integer is
range-checked (``0 <= v <= 2**63 - 1``: torch's int64 sizes, and file offsets) before any arithmetic, every string is
length-capped, and a message that quotes a value shows it through :func:`~moeckpt.formats.render.bounded_repr` (a
pickle can hold a list that expands to 10**9 elements through memo references, or an integer too long to format).
The bounds and why: docs/interop.md, "The safety model".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, cast

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box, covers_exactly_once
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import check_relative_path
from moeckpt.formats.render import bounded_repr

from . import bounds
from . import unpickler as up

METADATA_NAME = ".metadata"
#: refuse a ``.metadata`` larger than this, before reading any of it: about twice what a 1,024-rank save of the
#: largest MoE training state measured writes (docs/interop.md, "The safety model").
MAX_METADATA_BYTES = 1024**3
#: every size, offset and length is one of torch's int64 (tensor sizes) or a byte offset in a file.
MAX_INT = up.MAX_INT
#: most dimensions a tensor may have (torch's own limit).
MAX_NDIM = 64
#: longest state-dict key (a flattened module path is tens of characters).
MAX_NAME_CHARS = 1024
#: longest data file path.
MAX_PATH_CHARS = up.MAX_PATH_CHARS
#: longest version string kept.
MAX_VERSION_CHARS = 64
#: a tensor's chunks are checked for an exact cover on the grid of their boundaries when it has at most this many
#: cells per chunk (DTensor shards always form a grid: one cell each); otherwise pairwise, when few enough.
_GRID_CELLS_PER_CHUNK = 4
_PAIRWISE_CHUNKS = 512


class DcpFormatError(MoeckptError, ValueError):
    """A DCP checkpoint that cannot be read: missing, truncated or inconsistent ``.metadata`` or data files."""


@dataclass(frozen=True)
class Record:
    """Where an item's bytes are: ``[offset, offset + length)`` of ``file`` (relative to the checkpoint)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpChunk:
    """One written chunk of a tensor: its box in the global tensor and the record holding its bytes."""

    box: Box
    record: Record


@dataclass(frozen=True)
class DcpTensor:
    """A logical tensor of the checkpoint (a flattened state-dict key)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[DcpChunk, ...]

    @property
    def nbytes(self) -> int:
        return Box.full(self.shape).numel * itemsize(self.dtype)

    @property
    def storable(self) -> bool:
        """Whether moeckpt stores this dtype (complex RoPE tables, unsigned ints wider than 8 bits it does not)."""
        return self.dtype in dtypes.DTYPE_NAMES


#: element sizes of the dtypes a DCP checkpoint may hold that moeckpt does not store (read only to be skipped).
_OTHER_ITEMSIZE = {"complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4, "uint64": 8}


def itemsize(dtype: str) -> int:
    return dtypes.itemsize(dtype) if dtype in dtypes.DTYPE_NAMES else _OTHER_ITEMSIZE[dtype]


@dataclass(frozen=True)
class DcpMetadata:
    """What ``.metadata`` says: tensors, non-tensor (bytes) items, the DCP version and the saver's extras."""

    tensors: dict[str, DcpTensor]
    values: dict[str, Record]
    version: str | None
    #: state-dict keys of the planner data (Megatron-Core keeps its own there), for information only.
    planner_keys: tuple[str, ...] = ()


def _cls(module: str, name: str) -> type[up._Record]:
    """The stand-in class the restricted unpickler builds for DCP's ``module.name``."""
    return cast("type[up._Record]", up.METADATA_CLASSES[(module, name)])


def _fail(where: str, what: str) -> DcpFormatError:
    return DcpFormatError(f"{where}: {what}; the .metadata is corrupt or not written by torch.distributed.checkpoint")


def _int(value: object, where: str, what: str) -> int:
    """A non-negative int64 from the file (``bool`` is not one)."""
    if type(value) is not int or not 0 <= value <= MAX_INT:
        raise _fail(where, f"{what} is {bounded_repr(value)}, not an integer from 0 to 2**63 - 1")
    return value


def _size(value: object, where: str, what: str) -> tuple[int, ...]:
    """A shape or offsets: a list of at most ``MAX_NDIM`` non-negative int64s."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) > MAX_NDIM
        or not all(type(v) is int and 0 <= v <= MAX_INT for v in value)
    ):
        raise _fail(
            where, f"{what} is {bounded_repr(value)}, not a list of at most {MAX_NDIM} integers from 0 to 2**63 - 1"
        )
    return tuple(value)


def _name(value: object, where: str, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise _fail(where, f"{what} is {bounded_repr(value)}, not a name of 1 to {MAX_NAME_CHARS} characters")
    return str(value)


def _record(info: Any, where: str) -> Record:
    if not isinstance(info, _cls("torch.distributed.checkpoint.filesystem", "_StorageInfo")):
        raise _fail(where, f"a storage entry is {bounded_repr(info)}, not a _StorageInfo")
    path = info.get("relative_path")
    if not isinstance(path, str) or len(path) > MAX_PATH_CHARS:
        raise _fail(where, f"a storage entry's file is {bounded_repr(path)}, not a path of at most {MAX_PATH_CHARS}")
    check_relative_path(str(path), where)
    shown = bounded_repr(path)
    offset = _int(info.get("offset"), where, f"the offset of an item in {shown}")
    length = _int(info.get("length"), where, f"the length of an item in {shown}")
    if offset + length > MAX_INT:
        raise _fail(where, f"an item in {shown} at byte {offset} of length {length} ends past 2**63 - 1")
    transforms = info.get("transform_descriptors")
    if transforms:
        raise DcpFormatError(
            f"{where}: items of {shown} were saved through storage transforms {bounded_repr(transforms)} "
            "(compression extensions); moeckpt reads plain DCP files only: re-save without extensions"
        )
    return Record(file=str(path), offset=offset, length=length)


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """Parse ``.metadata`` bytes (never running them) and validate them as a DCP checkpoint's index."""
    if len(data) > MAX_METADATA_BYTES:
        raise DcpFormatError(f"{where}: {len(data)} bytes is larger than any DCP metadata moeckpt reads")
    return _validate(up.load_metadata_pickle(data, where), where)


def read_metadata(read: bounds.Read, where: str, size: int | None = None) -> DcpMetadata:
    """Read ``.metadata`` through ``read(n)`` (up to ``n`` more bytes, ``b""`` at the end) of a file of ``size``
    bytes, checking the pickle's opcodes as they come (:func:`~moeckpt.formats.dcp.bounds.scan`: garbage is refused
    after its first bytes), then parse and validate it as :func:`parse_metadata` does. The caller bounds what
    ``read`` returns."""
    data = bounds.scan(read, where, size=size)
    return _validate(up.load_metadata_pickle(data, where, scanned=True), where)


def _validate(md: Any, where: str) -> DcpMetadata:
    meta_cls = _cls("torch.distributed.checkpoint.metadata", "Metadata")
    if not isinstance(md, meta_cls):
        raise _fail(where, f"the pickle holds {bounded_repr(md)}, not a DCP Metadata")
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _fail(where, "state_dict_metadata and storage_data must be dictionaries")
    index_cls = _cls("torch.distributed.checkpoint.metadata", "MetadataIndex")
    records: dict[tuple[str, tuple[int, ...] | None], Record] = {}
    for key, info in storage.items():
        if not isinstance(key, index_cls):
            raise _fail(where, f"a storage key is {bounded_repr(key)}, not a MetadataIndex")
        fqn = _name(key.get("fqn"), where, "a storage key's name")
        offset = key.get("offset")
        records[(fqn, None if offset is None else _size(offset, where, "a storage key's offset"))] = _record(
            info, where
        )
    tensor_cls = _cls("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    bytes_cls = _cls("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
    tensors: dict[str, DcpTensor] = {}
    values: dict[str, Record] = {}
    for key, item in sdm.items():
        name = _name(key, where, "a state-dict key")
        if isinstance(item, bytes_cls):
            rec = records.get((name, None))
            if rec is None:
                raise _fail(where, f"value {bounded_repr(name)} has no storage record")
            values[name] = rec
        elif isinstance(item, tensor_cls):
            tensors[name] = _tensor(name, item, records, where)
        else:
            raise _fail(
                where, f"key {bounded_repr(name)} holds {bounded_repr(item)}, neither tensor nor bytes metadata"
            )
    planner = md.get("planner_data")
    version = md.get("version")
    return DcpMetadata(
        tensors=tensors,
        values=values,
        version=str(version) if isinstance(version, str) and len(version) <= MAX_VERSION_CHARS else None,
        planner_keys=tuple(str(k) for k in planner if isinstance(k, str) and len(k) <= MAX_NAME_CHARS)
        if isinstance(planner, dict)
        else (),
    )


def _tensor(name: str, item: Any, records: dict, where: str) -> DcpTensor:
    here = f"{where}: tensor {bounded_repr(name)}"
    shape = _size(item.get("size"), here, "the size")
    numel = 1
    for d in shape:
        numel *= d
        if numel > MAX_INT:
            raise _fail(here, f"its size {list(shape)} holds more than 2**63 - 1 elements")
    props = item.get("properties")
    dtype = props.get("dtype") if isinstance(props, up._Record) else None
    if not isinstance(dtype, up.DType):
        raise _fail(here, f"the dtype is {bounded_repr(dtype)}")
    if numel * itemsize(str(dtype)) > MAX_INT:
        raise _fail(here, f"its size {list(shape)} of {dtype} holds more than 2**63 - 1 bytes")
    layout = props.get("layout", "torch.strided")
    if layout != "torch.strided":
        raise DcpFormatError(f"{here}: layout {bounded_repr(layout)} is not supported (dense tensors only)")
    chunks = item.get("chunks")
    if not isinstance(chunks, list):
        raise _fail(here, f"chunks must be a list, not {bounded_repr(chunks)}")
    out = []
    for c in chunks:
        if not isinstance(c, _cls("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata")):
            raise _fail(here, f"a chunk is {bounded_repr(c)}, not a ChunkStorageMetadata")
        offsets = _size(c.get("offsets"), here, "a chunk's offsets")
        sizes = _size(c.get("sizes"), here, "a chunk's sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _fail(
                here,
                f"a chunk's offsets {list(offsets)} and sizes {list(sizes)} do not both have the tensor's "
                f"{len(shape)} dimensions",
            )
        box = Box(offsets, sizes)
        if not box.within(shape):
            raise _fail(here, f"chunk {box.to_json()} does not lie inside its shape {list(shape)}")
        rec = records.get((name, box.offsets))
        if rec is None:
            raise _fail(here, f"chunk at offsets {list(box.offsets)} has no storage record")
        out.append(DcpChunk(box=box, record=rec))
    problem = _cover_problem(shape, [c.box for c in out if not c.box.is_empty()])
    if problem is not None:
        raise DcpFormatError(
            f"{here}: its chunks do not cover it exactly once ({problem}); the checkpoint is incomplete"
        )
    return DcpTensor(name=name, shape=shape, dtype=str(dtype), chunks=tuple(out))


def _cover_problem(shape: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Why ``boxes`` (non-empty, inside ``shape``) do not tile ``shape`` exactly once, or ``None`` if they do.

    On the grid that the boxes' boundaries span, each box covers whole cells, and the boxes tile the tensor exactly
    when every cell is covered once: linear in the cells, which DTensor shards (always a product of per-dimension
    splits) make one per box. A pairwise check is quadratic in the boxes, so it only serves small irregular sets;
    a large one that forms no grid is refused (no ``dcp.save`` writes one).
    """
    if not shape or 0 in shape:
        want = 0 if shape else 1
        return None if len(boxes) == want else f"{len(boxes)} chunks hold the {want} elements of the tensor"
    cuts = [
        sorted({0, n}.union(*({b.offsets[d], b.offsets[d] + b.shape[d]} for b in boxes))) for d, n in enumerate(shape)
    ]
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
        if cells > _GRID_CELLS_PER_CHUNK * len(boxes) + 64:
            break
    else:
        return _grid_problem(shape, boxes, cuts, cells)
    if len(boxes) <= _PAIRWISE_CHUNKS:
        return covers_exactly_once(shape, boxes)
    return f"its {len(boxes)} chunks do not form a grid of the tensor's dimensions, as DTensor shards do"


def _grid_problem(shape: tuple[int, ...], boxes: list[Box], cuts: list[list[int]], cells: int) -> str | None:
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * (len(cuts[d + 1]) - 1)
    seen = bytearray(cells)
    for b in boxes:
        spans = [
            range(at[d][o] * strides[d], at[d][o + n] * strides[d], strides[d])
            for d, (o, n) in enumerate(zip(b.offsets, b.shape))
        ]
        for parts in itertools.product(*spans):
            cell = sum(parts)
            if seen[cell]:
                return f"chunk {b.to_json()} overlaps another"
            seen[cell] = 1
    if seen.count(0):
        return f"{seen.count(0)} of the {cells} blocks their boundaries form are in no chunk: they leave gaps"
    return None
