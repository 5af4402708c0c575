"""A ``torch.distributed.checkpoint`` storage backend that reads and writes the moeckpt format.

``dcp.save(state_dict, storage_writer=StorageWriter(url))`` writes a moeckpt checkpoint: DCP plans the save
(which rank writes which chunk, replicated chunks once), and the writer stores each rank's chunks as the pieces of
its data file through the moeckpt backend (checksummed; safetensors or zarr; local disk or any fsspec URL), then
commits a JSON index last. ``dcp.load(state_dict, storage_reader=StorageReader(url))`` reads any moeckpt
checkpoint, those the bundled trainer wrote included: the reader describes the stored pieces to DCP as its
chunks, and DCP's planner reshards.

No pickle reaches the disk: DCP hands non-tensor values (a step, an optimizer's ``param_groups``) to a storage
writer already pickled, so the writer stores the original object from the planner's state dict as JSON, and
refuses one that is not JSON. On load, DCP's planner only accepts such values as ``torch.save`` bytes; the reader
makes them from the JSON value in memory, so they hold nothing but plain data.

DCP decides which rank writes each replicated chunk, so a DCP-written tensor's index entry does not compute its
pieces from a rule: its sharding is ``{"pieces": "stored"}``, and a reader finds the pieces in the data files'
headers (as it finds zarr cells).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _DcpReader
from torch.distributed.checkpoint.storage import StorageWriter as _DcpWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader, begin_save, commit, staging_storage
from moeckpt.formats.errors import MoeckptError, StateDictError
from moeckpt.formats.index import FileEntry, Index, TensorEntry, check_tensor_name
from moeckpt.formats.pieces import Piece
from moeckpt.reshard.commit import write_threads
from moeckpt.reshard.placement import STORED, is_stored, placements
from moeckpt.reshard.plan import source_layout
from moeckpt.reshard.runtime import paused_gc

from .state_dict import leaf_of
from .state_save import GENERIC_MODEL

__all__ = ["STORED", "StorageReader", "StorageWriter"]

log = logging.getLogger(__name__)


def _location(checkpoint_id) -> str:
    return os.fspath(checkpoint_id) if isinstance(checkpoint_id, os.PathLike) else str(checkpoint_id)


class StorageWriter(_DcpWriter):
    """``dcp.save`` into a moeckpt checkpoint at ``path`` (a local path or an fsspec URL).

    ``format`` is the moeckpt backend (``safetensors`` or ``zarr``); ``overwrite`` replaces a committed
    checkpoint there (else a non-empty destination is refused, as ``moeckpt.save`` does).
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        format: str = "safetensors",
        overwrite: bool = False,
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

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _location(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

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
        begin_save(self._where(), overwrite=self.overwrite)
        get_backend(self.format).prepare(staging_storage(self._where()), tensors, boxes)
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    # Without the collector's pauses, as moeckpt.save: the objects DCP's planning made just before would otherwise
    # be walked by full collections here (see paused_gc), and leave the pause in the oldest generation.
    @paused_gc()
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        writer = int(plan.storage_data if plan.storage_data is not None else self.rank)
        pieces, tensors, results, values = [], {}, [], {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                original = getattr(planner, "state_dict", {}).get(fqn)
                values[fqn] = leaf_of(fqn, original).local  # JSON, or StateDictError naming the key
                results.append(WriteResult(item.index, 0, {"value": values[fqn]}))
                continue
            td = _tensor_data(item)
            data = planner.resolve_data(item)
            if not isinstance(data, torch.Tensor):
                raise StateDictError(f"key {fqn!r}: DCP resolved it to {type(data).__name__}, not a tensor")
            check_tensor_name(fqn, "dcp.save")
            box = Box(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            entry = _entry(fqn, td.size, td.properties.dtype)
            tensors[fqn] = entry
            data = data.detach()
            pieces.append(Piece(fqn, box, data if data.device.type == "cpu" else data.cpu()))
            # The writer alone: the coordinator unpickles every rank's results, and a dict per item (with the
            # file list) made that several times slower.
            results.append(WriteResult(item.index, box.numel * dtypes.itemsize(entry.dtype), writer))
        # With the host's spare cores, as moeckpt.save writes (DCP's own FileSystemWriter writes with one thread).
        files = get_backend(self.format).write(
            staging_storage(self._where()), writer, pieces, tensors, threads=write_threads()
        )
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
        for rank_results in results:
            for r in rank_results:
                data = r.storage_data if isinstance(r.storage_data, dict) else {}
                if "value" in data:
                    values[r.index.fqn] = data["value"]
                for path, size, checksum in data.get("files", []):
                    files[path] = FileEntry(path=path, size=size, checksum=checksum)
        tensors = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                tensors[fqn] = _entry(fqn, md.size, md.properties.dtype)
        backend = get_backend(self.format)
        entries = backend.finish(staging_storage(self._where()), list(files.values()), tensors)
        index = Index(
            backend=self.format,
            step=self.step,
            layout={},
            model=dict(GENERIC_MODEL),
            tensors=tensors,
            files={e.path: e for e in entries},
            train_state=values,
        )
        commit(self._where(), index)
        log.info("dcp.save committed %s: %d tensors, %d files", self.path, len(tensors), len(index.files))

    def storage_meta(self):
        return None


def _entry(fqn: str, size, dtype: torch.dtype) -> TensorEntry:
    try:
        name = dtypes.from_torch(dtype)
    except ValueError as e:
        raise StateDictError(f"key {fqn!r}: {e}") from None
    return TensorEntry(
        name=fqn, shape=tuple(int(s) for s in size), dtype=name, role="param", param=fqn, sharding=dict(STORED)
    )


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
            fqn = item.index.fqn
            tensors.setdefault(fqn, _entry(fqn, td.size, td.properties.dtype))
            box = Box(tuple(int(o) for o in td.chunk.offsets), tuple(int(s) for s in td.chunk.sizes))
            if not box.is_empty():
                boxes.setdefault(fqn, []).append(box)
    return tensors, boxes


class StorageReader(_DcpReader):
    """``dcp.load`` from any moeckpt checkpoint at ``path`` (or a run directory: its newest committed step)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        super().__init__()
        self.path = None if path is None else _location(path)
        self._reader: CheckpointReader | None = None
        self._refs: dict[tuple[str, tuple[int, ...]], Any] = {}

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None:
            self.path = _location(checkpoint_id)
        self._reader = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def _open(self) -> CheckpointReader:
        if self._reader is None:
            if self.path is None:
                raise StateDictError("moeckpt.dcp.StorageReader: no path; pass one or dcp.load(checkpoint_id=...)")
            self._reader = CheckpointReader(self.path)
        return self._reader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        reader = self._open()
        index = reader.index
        stored = _stored_boxes(reader)
        md: dict[str, Any] = {}
        for name, entry in index.tensors.items():
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(b.offsets), sizes=torch.Size(b.shape)) for b in stored[name]
            ]
            md[name] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtypes.to_torch(entry.dtype)),
                size=torch.Size(entry.shape),
                chunks=chunks,
            )
        for key in index.train_state:
            if key not in md:
                md[key] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._open()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @paused_gc()
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reader = self._open()
        refs = {(r.tensor, r.box.offsets): r for r in reader.pieces(tensors={i.storage_index.fqn for i in plan.items})}
        for item in plan.items:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                if fqn not in reader.index.train_state:
                    raise StateDictError(f"{reader.location}: the checkpoint has no value {fqn!r}")
                buf = io.BytesIO()
                torch.save(reader.index.train_state[fqn], buf)  # plain JSON data, made here, for DCP's loader
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            offsets = tuple(int(o) for o in (item.storage_index.offset or ()))
            ref = refs.get((fqn, offsets))
            if ref is None:
                raise MoeckptError(f"{reader.location}: no stored piece of {fqn!r} at {list(offsets)}")
            start = tuple(int(o) for o in item.storage_offsets)
            lengths = tuple(int(n) for n in item.lengths)
            sub = Box(tuple(a + b for a, b in zip(offsets, start)), lengths)
            data = reader.read_box(fqn, sub, refs=[ref])
            target = planner.resolve_tensor(item).detach()
            target.copy_(data)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _stored_boxes(reader: CheckpointReader) -> dict[str, list[Box]]:
    """Every stored box of every tensor: from the sharding rules where they say, else from the files' headers."""
    index = reader.index
    out: dict[str, list[Box]] = {name: [] for name in index.tensors}
    listed = {n for n, e in index.tensors.items() if is_stored(e)} or None
    if index.backend != "safetensors" or listed:
        for ref in reader.pieces():
            out[ref.tensor].append(ref.box)
        return out
    layout = source_layout(index)
    for name, entry in index.tensors.items():
        out[name] = [p.box for p in placements(entry, layout) if not p.box.is_empty()]
    return out
