"""Export a moeckpt checkpoint, from any layout and storage, as a Hugging Face model directory.

The output is what ``transformers.AutoModelForCausalLM.from_pretrained`` reads: ``model-0000k-of-0000n.safetensors``
shards, ``model.safetensors.index.json`` (``total_size`` and the weight map), ``config.json`` and
``generation_config.json``. Logical tensors are streamed: each is read whole from the checkpoint (only its own
pieces), converted to the output dtype, written into the open shard and dropped, so memory holds two tensors (the
one being written and the next, read ahead), never the model. Shard headers are known up front (names and shapes
come from the plan), which is what lets a shard be written tensor by tensor; the directory's layout and commit are
:mod:`moeckpt.formats.hf_shards`'s.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing, nullcontext
from dataclasses import dataclass
from itertools import groupby
from types import ModuleType
from typing import Any

import numpy as np

from moeckpt.formats import dtypes
from moeckpt.formats.backend import PieceReader
from moeckpt.formats.checkpoint import CheckpointReader, ReusedBuffer, byte_view
from moeckpt.formats.hf_shards import (
    INDEX_FILE,
    HfExportError,
    ShardTensor,
    json_file,
    pack_shards,
    parse_size,
    write_shards,
)
from moeckpt.formats.pieces import tensor_bytes
from moeckpt.formats.roles import PARAM
from moeckpt.reshard.runtime import single_threaded_torch
from moeckpt.reshard.state_dict_checkpoints import is_state_dict

from .models import ARCHITECTURES, ModelSpec, UnknownModelError

__all__ = ["INDEX_FILE", "HfExportError", "export_hf", "hf_module", "parse_size"]


def hf_module(spec: ModelSpec) -> ModuleType:
    """The ``<arch>/hf.py`` mapping module of a model (config mapping, tensor names)."""
    return importlib.import_module(f"{spec.module.__name__}.hf")


@dataclass(frozen=True)
class HfTensor:
    """One tensor of the exported model: its HF name and shape, and the logical tensor it comes from."""

    name: str
    shape: tuple[int, ...]
    source: str

    def nbytes(self, dtype: str) -> int:
        n = dtypes.itemsize(dtype)
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ExportResult:
    files: tuple[str, ...]
    total_size: int
    num_tensors: int
    dtype: str


def spec_of(reader: CheckpointReader, model_override: ModelSpec | None = None) -> ModelSpec:
    """The checkpoint's model (or, for a state-dict checkpoint, ``model_override``: the bundled model its names
    are), refusing architectures without a Hugging Face mapping or configs missing a field."""
    if is_state_dict(reader.index):
        if model_override is None:
            raise HfExportError(
                f"{reader.location}: a state-dict checkpoint (moeckpt.save, moeckpt.dcp, import-dcp --mapping none) "
                "records no model; pass --model PRESET|config.json naming the bundled model its tensors are, or write "
                "its tensors under their own names with moeckpt consolidate"
            )
        model = model_override.to_json()
    elif model_override is not None:
        raise HfExportError(
            f"{reader.location}: the checkpoint records its model; --model is for state-dict checkpoints"
        )
    else:
        model = reader.index.model
    arch = model.get("arch")
    if arch not in ARCHITECTURES:
        raise HfExportError(
            f"{reader.location}: architecture {arch!r} has no Hugging Face mapping; exportable: {', '.join(ARCHITECTURES)}"
        )
    try:
        spec = ModelSpec.from_json(model)
    except UnknownModelError as e:
        raise HfExportError(f"{reader.location}: {e}") from None
    config = model.get("config", {})
    missing = [f for f in hf_module(spec).HF_FIELDS if f not in config]
    if missing:
        raise HfExportError(
            f"{reader.location}: the model config in the index lacks {', '.join(missing)}, which config.json needs; "
            "the checkpoint was written by a tool that did not record its full config"
        )
    return spec


def plan_tensors(spec: ModelSpec, reader: CheckpointReader) -> list[HfTensor]:
    """The HF tensors in write order, after checking the checkpoint holds every parameter of the plan."""
    hf = hf_module(spec)
    out = []
    if is_state_dict(reader.index):  # a trainer's state dict under the model's names (maybe below a prefix)
        from .interop.bundled import match_model_names
        from .interop.common import MappingError

        try:
            match_model_names(reader.index, spec, reader.location)  # every parameter is there, in its shape
        except MappingError as e:
            raise HfExportError(str(e)) from None
        for p in spec.param_specs():
            out += [HfTensor(n, s, p.name) for n, s in hf.export_tensors(p.name, p.shape, spec.config)]
        return out
    for p in spec.param_specs():
        entry = reader.index.tensors.get(p.name)
        if entry is None or entry.role != "param":
            raise HfExportError(
                f"{reader.location}: parameter {p.name!r} of the {spec.arch} model is not in the checkpoint"
            )
        if tuple(entry.shape) != tuple(p.shape):
            raise HfExportError(
                f"{reader.location}: {p.name} has shape {list(entry.shape)} but the model config gives {list(p.shape)}"
            )
        out += [HfTensor(n, s, p.name) for n, s in hf.export_tensors(p.name, p.shape, spec.config)]
    return out


def _value_source(reader: CheckpointReader, param: str, dtype: str) -> str:
    """The logical tensor to export parameter ``param`` from: its fp32 master copy when one is stored and the
    export is wider than the parameter (bf16 training, fp32 export: the master holds the bits bf16 rounded off)."""
    master = f"master/{param}"
    entry = reader.index.tensors.get(master)
    if entry is not None and dtypes.itemsize(entry.dtype) >= dtypes.itemsize(dtype) > dtypes.itemsize(
        reader.index.tensors[param].dtype
    ):
        return master
    return param


def export_hf(
    ckpt: str,
    out: str,
    *,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    model: ModelSpec | None = None,
) -> ExportResult:
    """Write the parameters of checkpoint ``ckpt`` as a Hugging Face model directory at ``out``.

    The next logical tensor is read (and verified) on a second thread while this one writes the last: memory holds
    at most two logical tensors (the largest two, in two reused buffers), and the source's reads overlap the
    output's writes instead of taking turns with them.

    ``model`` names the bundled model a state-dict checkpoint's tensors are (see
    :mod:`moeckpt.trainer.interop.bundled`); a checkpoint of the bundled trainer records its own.

    ``dtype`` is ``"bfloat16"`` or ``"float32"`` (default: the checkpoint's parameter dtype; a float32 export of
    bf16 parameters takes the fp32 master weights when the checkpoint has them). ``on_bytes`` is
    called with the bytes written after each tensor (progress bars). The export is staged and committed
    (:func:`moeckpt.formats.hf_shards.write_shards`): an interrupted or failed export leaves nothing at ``out``,
    and a failure to read the source is raised as that error (naming the source file), not as a failure to write
    the output.
    """
    reader = CheckpointReader(ckpt)
    spec = spec_of(reader, model)
    if max_shard_size < 1:
        raise HfExportError(f"max shard size must be positive, got {max_shard_size}")
    tensors = plan_tensors(spec, reader)
    # where each parameter is stored: under its own name, or (a state dict) where match_model_names found it
    stored: dict[str, str] = {}
    if is_state_dict(reader.index):
        from .interop.bundled import match_model_names

        found = match_model_names(reader.index, spec, reader.location).tensors
        stored = {p: n for (role, p), n in found.items() if role == PARAM}
    param_dtype = reader.index.tensors[stored.get(tensors[0].source, tensors[0].source)].dtype
    dtype = dtype or param_dtype
    if dtype not in ("bfloat16", "float32", "float16"):
        raise HfExportError(f"cannot export as {dtype!r}; choose bfloat16 or float32")
    hf = hf_module(spec)
    item = dtypes.itemsize(dtype)
    # Where every value is exported in the dtype it is stored in, the export only moves bytes: it reads them
    # without torch, and a command that never imports torch saves the seconds that import takes on a cold start
    # (docs/benchmarks/README.md, the families benchmark). A conversion goes through torch.
    moves_bytes = not stored and all(reader.index.tensors[t.source].dtype == dtype for t in tensors)

    def where_of(source: str) -> str:
        """The stored tensor that plan tensor ``source`` is exported from."""
        return stored.get(source) or _value_source(reader, source, dtype)

    def read_values(source: str, scratch: ReusedBuffer) -> dict[str, Any]:
        """The HF tensors cut from logical tensor ``source``, read into ``scratch`` (a damaged source raises here,
        named as itself): byte views of them where the export moves bytes, else tensors."""
        where = where_of(source)
        entry = reader.index.tensors[where]
        if moves_bytes:
            raw = scratch.get_bytes(entry.nbytes)
            if reader.read_bytes(where, raw, session):
                return hf.export_values(source, byte_view(raw, entry.shape, item), spec.config)
        out = scratch.get(entry.shape, dtypes.to_torch(entry.dtype))
        full = reader.read_tensor(where, out=out, session=session).to(dtypes.to_torch(dtype))
        return hf.export_values(source, full, spec.config)

    sources = {t.name: t.source for t in tensors}
    shards = pack_shards((ShardTensor(t.name, dtype, t.shape) for t in tensors), max_shard_size)
    # the logical tensors in the order the shards take their HF tensors (one run per logical tensor)
    order = [s for s, _ in groupby(sources[t.name] for shard in shards for t in shard)]
    largest = max((reader.index.tensors[where_of(s)].nbytes for s in order), default=0)
    ahead = ReadAhead(order, read_values, reserve=largest)
    unwritten: dict[str, Any] = {}  # the HF tensors of the logical tensor being written, not yet written

    def produce(t: ShardTensor) -> Iterator[bytes | memoryview]:
        if not unwritten:
            unwritten.update(ahead.next(sources[t.name]))
        yield value_bytes(unwritten.pop(t.name))

    def configs() -> dict[str, bytes]:
        return {
            "generation_config.json": json_file({"_from_model_config": True, **hf.generation_config(spec.config)}),
            "config.json": json_file(hf.to_hf_config(spec.config, dtype=dtype)),
        }

    # Each conversion on one core (the read-ahead thread's): torch's intra-op pool spreading it over the cores
    # bought no time and cost CPU that a training job beside the export wants (docs/benchmarks/README.md,
    # "Figures behind the code's defaults").
    threads = nullcontext() if moves_bytes else single_threaded_torch()
    session: PieceReader
    with threads, closing(reader.open_reader()) as session, ahead:
        written = write_shards(out, shards, produce, overwrite=overwrite, extra_files=configs, on_bytes=on_bytes)
    return ExportResult(files=written.files, total_size=written.total_size, num_tensors=len(tensors), dtype=dtype)


def value_bytes(value: Any) -> memoryview:
    """The bytes an HF tensor is written as: of a byte view (the export that moves bytes) or of a tensor."""
    return value.reshape(-1).data if isinstance(value, np.ndarray) else tensor_bytes(value)


class ReadAhead:
    """The logical tensors of an export read one ahead, on a thread of their own, into two reused buffers in turn.

    ``next(source)`` returns ``read(source, buffer)`` (the HF tensors cut from it) and starts the read of the
    tensor after it; a read's error is raised by the ``next`` that asks for it. A buffer is reused two tensors
    later, when every HF tensor cut from it has been written: the writer asks for tensor ``i + 1`` only after
    writing all of ``i``'s, and the read that starts then is ``i + 2``'s, into ``i``'s buffer.
    """

    def __init__(self, order: list[str], read: Callable[[str, ReusedBuffer], dict[str, Any]], reserve: int = 0) -> None:
        self._order = order
        self._read = read
        self._buffers = (ReusedBuffer(reserve), ReusedBuffer(reserve))  # each at once the largest read's size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeckpt-export-read")
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._at = 0

    def _start(self, i: int) -> None:
        if i < len(self._order) and i not in self._pending:
            self._pending[i] = self._pool.submit(self._read, self._order[i], self._buffers[i % 2])

    def next(self, source: str) -> dict[str, Any]:
        i = self._at
        if i >= len(self._order) or self._order[i] != source:  # a bug in the caller's order, not a user error
            raise RuntimeError(f"export asked for {source!r}, expected {self._order[i : i + 1]}")
        self._start(i)
        values = self._pending.pop(i).result()
        self._at = i + 1
        self._start(i + 1)
        return values

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self._pending.values():
            f.cancel()
        self._pool.shutdown(wait=True)  # a read in flight ends before the session it reads through is closed
