"""A torch DCP checkpoint's ``.metadata``, read without running it: logical tensors, their chunks, and where each
chunk's bytes are.

DCP's ``Metadata`` maps every state-dict key (flattened, dotted) to either a ``TensorStorageMetadata`` (global
size, dtype, the chunks that were written: offsets and sizes) or a ``BytesStorageMetadata`` (a ``torch.save`` of a
non-tensor value), and ``storage_data`` maps each item (key plus chunk offsets) to a ``_StorageInfo``: the file
(relative path), the byte offset and the length of its record. This module turns the restricted unpickler's
stand-ins into :class:`DcpMetadata` and checks everything a reader relies on: every path stays inside the
directory, every chunk lies inside its tensor and has a storage record, the chunks of a tensor cover it exactly
once, no transform (compression) is applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box, covers_exactly_once
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import check_relative_path

from . import unpickler as up

METADATA_NAME = ".metadata"
#: refuse a ``.metadata`` larger than this: a DCP index of millions of chunks is some hundreds of MB.
MAX_METADATA_BYTES = 4 * 1024**3


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


def _size(value: object, where: str, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and v >= 0 for v in value):
        raise _fail(where, f"{what} is {value!r}, not a list of non-negative integers")
    return tuple(value)


def _record(info: Any, where: str) -> Record:
    if not isinstance(info, _cls("torch.distributed.checkpoint.filesystem", "_StorageInfo")):
        raise _fail(where, f"a storage entry is a {type(info).__name__}, not a _StorageInfo")
    path, offset, length = info.get("relative_path"), info.get("offset"), info.get("length")
    check_relative_path(path, where)
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        raise _fail(where, f"storage entry of {path!r} has offset {offset!r} and length {length!r}")
    transforms = info.get("transform_descriptors")
    if transforms:
        raise DcpFormatError(
            f"{where}: items of {path!r} were saved through storage transforms {list(transforms)!r} (compression "
            "extensions); moeckpt reads plain DCP files only: re-save without extensions"
        )
    return Record(file=path, offset=offset, length=length)


def parse_metadata(data: bytes, where: str) -> DcpMetadata:
    """Parse ``.metadata`` bytes (never running them) and validate them as a DCP checkpoint's index."""
    if len(data) > MAX_METADATA_BYTES:
        raise DcpFormatError(f"{where}: {len(data)} bytes is larger than any DCP metadata moeckpt reads")
    md: Any = up.load_metadata_pickle(data, where)
    meta_cls = _cls("torch.distributed.checkpoint.metadata", "Metadata")
    if not isinstance(md, meta_cls):
        raise _fail(where, f"the pickle holds a {type(md).__name__}, not a DCP Metadata")
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _fail(where, "state_dict_metadata and storage_data must be dictionaries")
    index_cls = _cls("torch.distributed.checkpoint.metadata", "MetadataIndex")
    records: dict[tuple[str, tuple[int, ...] | None], Record] = {}
    for key, info in storage.items():
        if not isinstance(key, index_cls) or not isinstance(key.get("fqn"), str):
            raise _fail(where, f"a storage key is {key!r}, not a MetadataIndex")
        offset = key.get("offset")
        records[(key.get("fqn"), None if offset is None else _size(offset, where, "a storage key's offset"))] = _record(
            info, where
        )
    tensor_cls = _cls("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")
    bytes_cls = _cls("torch.distributed.checkpoint.metadata", "BytesStorageMetadata")
    tensors: dict[str, DcpTensor] = {}
    values: dict[str, Record] = {}
    for name, item in sdm.items():
        if not isinstance(name, str) or not name:
            raise _fail(where, f"state-dict key {name!r} is not a non-empty string")
        if isinstance(item, bytes_cls):
            rec = records.get((name, None))
            if rec is None:
                raise _fail(where, f"value {name!r} has no storage record")
            values[name] = rec
        elif isinstance(item, tensor_cls):
            tensors[name] = _tensor(name, item, records, where)
        else:
            raise _fail(where, f"key {name!r} holds a {type(item).__name__}, neither tensor nor bytes metadata")
    planner = md.get("planner_data")
    version = md.get("version")
    return DcpMetadata(
        tensors=tensors,
        values=values,
        version=version if isinstance(version, str) else None,
        planner_keys=tuple(k for k in planner if isinstance(k, str)) if isinstance(planner, dict) else (),
    )


def _tensor(name: str, item: Any, records: dict, where: str) -> DcpTensor:
    here = f"{where}: tensor {name!r}"
    shape = _size(item.get("size"), here, "the size")
    props = item.get("properties")
    dtype = props.get("dtype") if isinstance(props, up._Record) else None
    if not isinstance(dtype, up.DType):
        raise _fail(here, f"the dtype is {dtype!r}")
    layout = props.get("layout", "torch.strided")
    if layout != "torch.strided":
        raise DcpFormatError(f"{here}: layout {layout} is not supported (dense tensors only)")
    chunks = item.get("chunks")
    if not isinstance(chunks, list):
        raise _fail(here, "chunks must be a list")
    out = []
    for c in chunks:
        if not isinstance(c, up._Record):
            raise _fail(here, f"a chunk is {c!r}")
        box = Box(_size(c.get("offsets"), here, "a chunk's offsets"), _size(c.get("sizes"), here, "a chunk's sizes"))
        if not box.within(shape):
            raise _fail(here, f"chunk {box.to_json()} does not lie inside its shape {list(shape)}")
        rec = records.get((name, box.offsets))
        if rec is None:
            raise _fail(here, f"chunk at offsets {list(box.offsets)} has no storage record")
        out.append(DcpChunk(box=box, record=rec))
    problem = covers_exactly_once(shape, [c.box for c in out if not c.box.is_empty()])
    if problem is not None:
        raise DcpFormatError(
            f"{here}: its chunks do not cover it exactly once ({problem}); the checkpoint is incomplete"
        )
    return DcpTensor(name=name, shape=shape, dtype=str(dtype), chunks=tuple(out))
