"""A ``torch.distributed.checkpoint`` storage backend that reads and writes the moeckpt format.

``dcp.save(state_dict, storage_writer=StorageWriter(url))`` writes a moeckpt checkpoint: DCP plans the save
(which rank writes which chunk, replicated chunks once), and the writer stores each rank's chunks as the pieces of
its data file through the moeckpt backend (checksummed; safetensors or zarr; local disk or any fsspec URL), then
commits a JSON index last. ``dcp.load(state_dict, storage_reader=StorageReader(url))`` reads any moeckpt
checkpoint, those the bundled trainer wrote included: the reader describes the stored pieces to DCP as its
chunks, and DCP's planner reshards.

It stands in for DCP's ``FileSystemWriter``/``FileSystemReader``: a save replaces only its own files (see
:mod:`.dcp_commit`); every key DCP accepts is stored, under a safe name (:func:`.dcp_values.encode_key`); the
planner's hooks run (a custom ``transform_object``'s bytes are what the load planner's ``load_bytes`` gets back);
the metadata DCP reads back keeps its ``planner_data`` and ``version`` (``storage_meta`` names the checkpoint and
the load; the save's random ``save_id`` is not stored, so the index of a state is the same bytes every time).

No pickle reaches the disk: a non-tensor value from DCP's default planner is stored from the original object as
typed JSON, its bytes and tensors as tensors of the data files (:mod:`.dcp_values`). On load, DCP's planner only
accepts such values as ``torch.save`` bytes; the reader makes them in memory from what it read, so they hold
nothing but plain data, tensors and byte buffers.

DCP decides which rank writes each replicated chunk, so a DCP-written tensor's index entry does not compute its
pieces from a rule: its sharding is ``{"pieces": "stored"}``, and a reader finds the pieces in the data files'
headers (as it finds zarr cells).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, staging_storage
from moeckpt.formats.errors import MoeckptError, StateDictError
from moeckpt.formats.index import DCP_CONFIG_KEY, FileEntry, Index, TensorEntry, check_tensor_name
from moeckpt.formats.pieces import Piece
from moeckpt.formats.storage import is_url, strip_file_scheme
from moeckpt.formats.storages import FsspecStorage, S3Storage, storage_class
from moeckpt.reshard.placement import STORED, is_stored, placements
from moeckpt.reshard.plan import source_layout
from moeckpt.reshard.runtime import paused_gc
from moeckpt.reshard.save_protocol import write_threads

from .dcp_commit import Destination, prepare_destination, top_level_names
from .dcp_values import Blob, blob_name, blob_names, decode_key, decode_value, encode_key, encode_value, stream_value
from .state_save import GENERIC_MODEL

__all__ = ["DCP_VERSION", "STORED", "StorageReader", "StorageWriter"]

log = logging.getLogger(__name__)

#: the DCP metadata version a save records (FileSystemWriter's ``CURRENT_DCP_VERSION``).
DCP_VERSION = "1.0.0"


def _location(checkpoint_id) -> str:
    return os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)


def _handles(checkpoint_id) -> bool:
    """Whether a checkpoint id is one the storages can open: a local path, or a URL whose scheme is registered,
    S3, or one fsspec has an installed implementation for (so DCP's detection of the storage is right)."""
    if isinstance(checkpoint_id, os.PathLike):
        return True
    if not isinstance(checkpoint_id, str) or not checkpoint_id:
        return False
    location = strip_file_scheme(checkpoint_id)
    if not is_url(location):
        return True
    cls = storage_class(location)
    if cls not in (FsspecStorage, S3Storage):
        return True  # a registered scheme
    try:
        import fsspec

        fsspec.get_filesystem_class(location.partition("://")[0])
    except (ImportError, ValueError):
        return False
    return True


class StorageWriter(_DcpWriter):
    """``dcp.save`` into a moeckpt checkpoint at ``path`` (a local path or an fsspec URL).

    ``format`` is the moeckpt backend (``safetensors`` or ``zarr``). ``overwrite`` (the default, as DCP's
    FileSystemWriter) replaces a committed checkpoint there; ``overwrite=False`` refuses one. Either way only the
    checkpoint's own files are replaced: other files at ``path`` stay.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        format: str = "safetensors",
        overwrite: bool = True,
        step: int = 0,
    ) -> None:
        super().__init__()
        self.path = None if path is None else _location(path)
        self.format = format
        get_backend(format)  # an unknown format fails here, before DCP starts
        self.overwrite = overwrite
        self.step = step
        self.rank = 0
        self.is_coordinator = True
        self.save_id = uuid.uuid4().hex
        self._destination: Destination | None = None

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _location(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._destination = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _handles(checkpoint_id)

    def _where(self) -> str:
        if self.path is None:
            raise StateDictError("moeckpt.dcp.StorageWriter: no path; pass one or dcp.save(checkpoint_id=...)")
        return self.path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._where()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=self.rank)

    @paused_gc()
    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator prepares the destination before any rank writes (DCP runs this between the local plans
        # and the writes; an error here reaches every rank through DCP).
        tensors, boxes = _tensors_of(plans)
        values = [blob_name(i.index.fqn, 0) for p in plans for i in p.items if i.type == WriteItemType.BYTE_IO]
        new_top = top_level_names(self.format, len(plans), list(tensors) + values)
        self._destination = prepare_destination(self._where(), overwrite=self.overwrite, new_top=new_top)
        get_backend(self.format).prepare(staging_storage(self._where()), tensors, boxes)
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    # Without the collector's pauses, as moeckpt.save: the objects DCP's planning made just before would otherwise
    # be walked by full collections here (see paused_gc), and leave the pause in the oldest generation.
    @paused_gc()
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        writer = int(plan.storage_data if plan.storage_data is not None else self.rank)
        pieces, tensors, results = [], {}, []
        blob_pieces, blob_entries = [], {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                value, blobs = _stored_value(item, planner)
                for b in blobs:
                    blob_entries[b.name] = _blob_entry(b)
                    blob_pieces.append(Piece(b.name, Box.full(tuple(b.data.shape)), b.data))
                kinds = {b.name: [list(b.data.shape), blob_entries[b.name].dtype] for b in blobs}
                results.append(WriteResult(item.index, 0, {"value": value, "blobs": kinds}))
                continue
            td = _tensor_data(item)
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise StateDictError(f"key {fqn!r}: DCP resolved it to {type(data).__name__}, not a tensor")
            box = Box(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            entry = _entry(fqn, td.size, td.properties.dtype)
            tensors[entry.name] = entry
            data = data.detach()
            pieces.append(Piece(entry.name, box, data if data.device.type == "cpu" else data.cpu()))
            # The writer alone: the coordinator unpickles every rank's results, and a dict per item (with the
            # file list) made that several times slower.
            results.append(WriteResult(item.index, box.numel * dtypes.itemsize(entry.dtype), writer))
        backend = get_backend(self.format)
        staging = staging_storage(self._where())
        if blob_entries:
            # Their sizes are known only now, on the rank that writes them: it sets up their storage itself (a
            # no-op for safetensors; the arrays' documents for zarr, which no other rank writes).
            backend.prepare(staging, blob_entries, {n: [p.box] for n, p in zip(blob_entries, blob_pieces)})
        # With the host's spare cores, as moeckpt.save writes (DCP's own FileSystemWriter writes with one thread).
        files = backend.write(staging, writer, pieces + blob_pieces, tensors | blob_entries, threads=write_threads())
        # The rank's files (an empty one for a rank with nothing to write) travel in one result of their own.
        results.append(
            WriteResult(
                MetadataIndex(f"__moeckpt_rank_{writer}_files"),
                0,
                {"writer": writer, "files": [[f.path, f.size, f.checksum] for f in files]},
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @paused_gc()
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileEntry] = {}
        values: dict[str, Any] = {}
        tensors: dict[str, TensorEntry] = {}
        for rank_results in results:
            for r in rank_results:
                data = r.storage_data if isinstance(r.storage_data, dict) else {}
                if "value" in data:
                    values[r.index.fqn] = data["value"]
                    for name, (shape, dtype) in data.get("blobs", {}).items():
                        tensors[name] = _tensor_entry(name, shape, dtype)
                for path, size, checksum in data.get("files", []):
                    files[path] = FileEntry(path=path, size=size, checksum=checksum)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                entry = _entry(fqn, md.size, md.properties.dtype)
                tensors[entry.name] = entry
        backend = get_backend(self.format)
        entries = backend.finish(staging_storage(self._where()), list(files.values()), tensors)
        index = Index(
            backend=self.format,
            step=self.step,
            layout={},
            model={**GENERIC_MODEL, "config": {DCP_CONFIG_KEY: self._dcp_config(metadata)}},
            tensors=tensors,
            files={e.path: e for e in entries},
            train_state=values,
        )
        destination = self._destination
        if destination is None:  # finish without prepare_global_plan: DCP always runs it first
            raise StateDictError("moeckpt.dcp.StorageWriter.finish: the save was not planned (no prepare_global_plan)")
        destination.commit(index)
        self._destination = None
        log.info("dcp.save committed %s: %d tensors, %d files", self.path, len(tensors), len(index.files))

    def _dcp_config(self, metadata: Metadata) -> dict[str, Any]:
        """What DCP's metadata holds besides tensors and values: the planner's data (DefaultSavePlanner's flattening
        mappings) and the metadata version. Not the save's random id: the same state saved twice writes the same
        index, byte for byte."""
        out: dict[str, Any] = {"version": DCP_VERSION}
        if metadata.planner_data is not None:
            data = metadata.planner_data
            if isinstance(data, dict) and all(isinstance(k, str) for k in data):
                data = dict(sorted(data.items()))  # the ranks' plans merge in no fixed order
            planner_data, blobs = encode_value("planner_data", data)
            if blobs:
                raise StateDictError("the save planner's planner_data holds tensors or bytes, which cannot be saved")
            out["planner_data"] = planner_data
        return out

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


def _stored_value(item: WriteItem, planner: SavePlanner) -> tuple[Any, list[Blob]]:
    """A non-tensor item as the planner resolves it: from the original object when the planner is DCP's default
    one (whose transform is ``torch.save``, which the loader's default ``load_bytes`` undoes), else the bytes the
    planner's own ``resolve_data``/``transform_object`` produced, stored as they are."""
    fqn = item.index.fqn
    kind = type(planner)
    if (
        isinstance(planner, DefaultSavePlanner)
        and kind.resolve_data is DefaultSavePlanner.resolve_data
        and getattr(kind, "transform_object", None) is DefaultSavePlanner.transform_object
    ):
        return encode_value(fqn, planner.lookup_object(item.index))
    data = planner.resolve_data(item)
    if isinstance(data, io.BytesIO):
        return stream_value(fqn, data.getbuffer())
    if isinstance(data, (bytes, bytearray, memoryview)):
        return stream_value(fqn, data)
    raise StateDictError(
        f"key {fqn!r}: the save planner resolved a non-tensor item to {type(data).__name__}; DCP's storage writers "
        "take an io.BytesIO for such items (what the planner's transform_object returns)"
    )


def _tensor_entry(name: str, shape, dtype: str) -> TensorEntry:
    check_tensor_name(name, "dcp.save")
    return TensorEntry(
        name=name, shape=tuple(int(s) for s in shape), dtype=dtype, role="param", param=name, sharding=dict(STORED)
    )


def _entry(fqn: str, size, dtype: torch.dtype) -> TensorEntry:
    try:
        name = dtypes.from_torch(dtype)
    except ValueError as e:
        raise StateDictError(f"key {fqn!r}: {e}") from None
    return _tensor_entry(encode_key(fqn), size, name)


def _blob_entry(blob: Blob) -> TensorEntry:
    return _tensor_entry(blob.name, blob.data.shape, dtypes.from_torch(blob.data.dtype))


def _tensor_data(item):
    """A tensor write item's chunk, size and properties (DCP always gives them for tensor items)."""
    if item.tensor_data is None:
        raise StateDictError(f"key {item.index.fqn!r}: DCP planned a tensor write without its tensor data")
    return item.tensor_data


def _tensors_of(plans: list[SavePlan]) -> tuple[dict[str, TensorEntry], dict[str, list[Box]]]:
    tensors: dict[str, TensorEntry] = {}
    boxes: dict[str, list[Box]] = {}
    for plan in plans:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue
            td = _tensor_data(item)
            entry = _entry(item.index.fqn, td.size, td.properties.dtype)
            tensors.setdefault(entry.name, entry)
            box = Box(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            if not box.is_empty():
                boxes.setdefault(entry.name, []).append(box)
    return tensors, boxes


class StorageReader(_DcpReader):
    """``dcp.load`` from any moeckpt checkpoint at ``path`` (or a run directory: its newest committed step)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.path = None if path is None else _location(path)
        self.load_id = uuid.uuid4().hex
        self._reader: CheckpointReader | None = None
        self._names: dict[str, str] = {}  # DCP key -> stored tensor name
        self._blobs: set[str] = set()
        self._typed = False  # values with '$type' objects and blobs (a version-3 index of dcp.save)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _location(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return _handles(checkpoint_id)

    def _open(self) -> CheckpointReader:
        if self._reader is None:
            if self.path is None:
                raise StateDictError("moeckpt.dcp.StorageReader: no path; pass one or dcp.load(checkpoint_id=...)")
            reader = CheckpointReader(self.path)
            # Only a version-3 index of dcp.save has escaped names and typed values (blobs): in any other a name
            # is its key as it stands and a value is plain JSON, whatever '%' or '$type' it holds.
            self._typed = reader.index.dcp_names
            if self._typed:
                self._blobs = {n for v in reader.index.train_state.values() for n in blob_names(v)}
                self._names = {decode_key(n): n for n in reader.index.tensors if n not in self._blobs}
            else:
                self._blobs, self._names = set(), {n: n for n in reader.index.tensors}
            self._reader = reader
        return self._reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        reader = self._open()
        index = reader.index
        stored = _stored_boxes(reader)
        md: dict[str, Any] = {}
        for key, name in self._names.items():
            entry = index.tensors[name]
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.shape)) for b in stored[name]
            ]
            md[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtypes.to_torch(entry.dtype)),
                size=torch.Size(entry.shape),
                chunks=chunks,
            )
        for key in index.train_state:
            if key not in md:
                md[key] = BytesStorageMetadata()
        config = index.model.get("config") if isinstance(index.model, dict) else None
        saved = config.get(DCP_CONFIG_KEY) if isinstance(config, dict) else None
        saved = saved if isinstance(saved, dict) else {}
        where = f"{reader.location}: model.config.{DCP_CONFIG_KEY}"
        planner_data = decode_value(saved.get("planner_data", {}), _no_blobs(where), where)
        if not isinstance(planner_data, dict):
            raise StateDictError(f"{where}: planner_data is {type(planner_data).__name__}, not a dict")
        # DCP's loaders look every key up in it: a key the save did not flatten (or a checkpoint that DCP did not
        # write) is its own one-part path.
        planner_data = {k: planner_data.get(k, (k,)) for k in md} | planner_data
        return Metadata(
            state_dict_metadata=md,
            planner_data=planner_data,
            storage_meta=StorageMeta(checkpoint_id=self.path, load_id=self.load_id),
            version=saved.get("version"),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @paused_gc()
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._open()
        wanted = {self._names.get(i.storage_index.fqn, i.storage_index.fqn) for i in plan.items}
        refs = {(r.tensor, r.box.offsets): r for r in reader.pieces(tensors=wanted)}
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value_bytes(reader, fqn))
                continue
            name = self._names.get(fqn, fqn)
            offsets = tuple(int(o) for o in (item.storage_index.offset or ()))
            ref = refs.get((name, offsets))
            if ref is None:
                raise MoeckptError(f"{reader.location}: no stored piece of {fqn!r} at {list(offsets)}")
            start = tuple(int(o) for o in item.storage_offsets)
            lengths = tuple(int(n) for n in item.lengths)
            sub = Box(tuple(a + b for a, b in zip(offsets, start)), lengths)
            data = reader.read_box(name, sub, refs=[ref])
            target = planner.resolve_tensor(item).detach()
            target.copy_(data)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _value_bytes(self, reader: CheckpointReader, key: str) -> io.BytesIO:
        """What the load planner's ``load_bytes`` gets: a custom save planner's bytes as it produced them, else
        ``torch.save`` bytes of the stored value, made here (plain data, tensors and byte buffers only)."""
        if key not in reader.index.train_state:
            raise StateDictError(f"{reader.location}: the checkpoint has no value {key!r}")
        where = f"{reader.location}: value {key!r}"
        stored = reader.index.train_state[key]
        if not self._typed:
            value = stored
        else:
            value = decode_value(stored, lambda name: _read_blob(reader, self._blobs, name), where)
        if self._typed and isinstance(stored, dict) and stored.get("$type") == "stream":
            value.seek(0)
            return value
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf


def _read_blob(reader: CheckpointReader, blobs: set[str], name: Any) -> torch.Tensor:
    if not isinstance(name, str) or name not in blobs or name not in reader.index.tensors:
        raise StateDictError(f"{reader.location}: a stored value refers to {name!r}, which is not one of its blobs")
    return reader.read_tensor(name)


def _no_blobs(where: str):
    def read(name: Any) -> torch.Tensor:
        raise StateDictError(f"{where}: refers to a blob ({name!r}); it may hold only JSON")

    return read


def _stored_boxes(reader: CheckpointReader) -> dict[str, list[Box]]:
    """Every stored box of every tensor: from the sharding rules where they say, else from the files' headers."""
    index = reader.index
    out: dict[str, list[Box]] = {name: [] for name in index.tensors}
    listed = {n for n, e in index.tensors.items() if is_stored(e)} or None
    if not reader.backend.stores_placements or listed:
        for ref in reader.pieces():
            out[ref.tensor].append(ref.box)
        return out
    layout = source_layout(index)
    for name, entry in index.tensors.items():
        out[name] = [p.box for p in placements(entry, layout) if not p.box.is_empty()]
    return out
