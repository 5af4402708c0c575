"""Export a moeckpt checkpoint, from any layout and storage, as a Hugging Face model directory.

The output is what ``transformers.AutoModelForCausalLM.from_pretrained`` reads: ``model-0000k-of-0000n.safetensors``
shards, ``model.safetensors.index.json`` (``total_size`` and the weight map), ``config.json`` and
``generation_config.json``. Logical tensors are streamed: each is read whole from the checkpoint (only its own
pieces), converted to the output dtype, written into the open shard and dropped, so memory holds one tensor, never
the model. Shard headers are known up front (names and shapes come from the plan), which is what lets a shard be
written tensor by tensor.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import DestinationNotEmptyError, MoeckptError
from moeckpt.formats.pieces import tensor_bytes
from moeckpt.formats.roles import PARAM
from moeckpt.formats.storage import Storage
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.state_dict_checkpoints import is_state_dict

from .interop.bundled import match_model_names
from .interop.common import MappingError
from .models import ARCHITECTURES, ModelSpec, UnknownModelError

INDEX_FILE = "model.safetensors.index.json"
#: the largest ``--max-shard-size`` taken (a petabyte: anything above is a typo).
MAX_SHARD_BYTES = 10**15
#: files an export writes (and ``overwrite`` replaces); anything else in the directory is left alone.
OWN_FILES = ("config.json", "generation_config.json", INDEX_FILE)


class HfExportError(MoeckptError, ValueError):
    """A checkpoint that cannot be written as a Hugging Face model (unknown architecture, incomplete config...)."""


def hf_module(spec: ModelSpec) -> ModuleType:
    """The ``<arch>/hf.py`` mapping module of a model (config mapping, tensor names)."""
    return importlib.import_module(f"{spec.module.__name__}.hf")


def shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


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
                "records no model; pass --model PRESET|config.json naming the bundled model its tensors are"
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


def assign_shards(tensors: list[HfTensor], dtype: str, max_shard_size: int) -> list[list[HfTensor]]:
    """Consecutive tensors packed into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own)."""
    shards: list[list[HfTensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.nbytes(dtype)
        if shards[-1] and size + n > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _header(tensors: list[HfTensor], dtype: str) -> bytes:
    doc: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        n = t.nbytes(dtype)
        doc[t.name] = {
            "dtype": dtypes.to_safetensors(dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _is_own(name: str) -> bool:
    return name in OWN_FILES or (name.startswith("model") and name.endswith(".safetensors"))


class _SourceFailed(BaseException):
    """Carries a failure to read the source checkpoint out of an output file's ``open_write`` block, which would
    otherwise report it as a failure to write the output file."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


class _Destination:
    """Where an export is written, and its commit: nothing at OUT is an export until it is complete.

    Local disk: everything goes into the sibling staging directory ``.<name>.partial`` (a rerun replaces what an
    interrupted export left there), which is renamed onto OUT at the end; files of OUT that are not the export's
    own (a tokenizer, a README) move over with ``overwrite``. Object stores: shards are written in place and
    ``config.json`` and the index last, so until the end OUT holds no loadable model; a previous export's index
    goes first, and shards without an index (an interrupted export) are replaced without ``overwrite``.
    """

    def __init__(self, out: str, overwrite: bool) -> None:
        self.final = open_storage(out)
        self.final.refuse_file()
        existing = self.final.listdir() if self.final.exists() else []
        committed = any(n in (INDEX_FILE, "config.json") for n in existing)
        if existing and not overwrite and (self.final.is_local or committed or not all(map(_is_own, existing))):
            raise DestinationNotEmptyError(
                f"{self.final.location}: destination is not empty; pass --overwrite to replace it"
            )
        self.existing = existing
        if self.final.is_local:
            parent, name = os.path.split(os.path.abspath(self.final.location).rstrip(os.sep))
            self.storage = open_storage(os.path.join(parent, f".{name}.partial"))
            self.storage.remove()
            self.storage.makedirs()
        else:
            self.storage = self.final
            for name in sorted(existing, key=lambda n: n not in (INDEX_FILE, "config.json")):  # uncommit first
                if _is_own(name):
                    self.final.remove(name)

    def commit(self) -> None:
        if not self.final.is_local:
            return
        staging, final = self.storage.location, self.final.location
        for name in self.existing:  # what OUT held besides a previous export stays in it
            if not _is_own(name):
                os.rename(os.path.join(final, name), os.path.join(staging, name))
        self.storage.fsync_dir()
        old = None
        if os.path.lexists(final):
            parent = os.path.dirname(os.path.abspath(final))
            old = os.path.join(parent, f".{os.path.basename(final)}.old-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        os.rename(staging, final)
        open_storage(os.path.dirname(os.path.abspath(final))).fsync_dir()
        if old is not None:
            open_storage(old).remove()

    def abort(self) -> None:
        """Remove what an export that failed wrote (local staging; on object stores the shards written)."""
        try:
            if self.final.is_local:
                self.storage.remove()
            else:
                for name in self.storage.listdir():
                    if _is_own(name):
                        self.storage.remove(name)
        except (OSError, MoeckptError):
            pass  # the next export replaces what is left


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

    ``model`` names the bundled model a state-dict checkpoint's tensors are (see
    :mod:`moeckpt.trainer.interop.bundled`); a checkpoint of the bundled trainer records its own.

    ``dtype`` is ``"bfloat16"`` or ``"float32"`` (default: the checkpoint's parameter dtype; a float32 export of
    bf16 parameters takes the fp32 master weights when the checkpoint has them). ``on_bytes`` is
    called with the bytes written after each tensor (progress bars). The export is staged and committed
    (:class:`_Destination`): an interrupted or failed export leaves nothing at ``out``, and a failure to read the
    source is raised as that error (naming the source file), not as a failure to write the output.
    """
    reader = CheckpointReader(ckpt)
    spec = spec_of(reader, model)
    if max_shard_size < 1:
        raise HfExportError(f"max shard size must be positive, got {max_shard_size}")
    tensors = plan_tensors(spec, reader)
    # where each parameter is stored: under its own name, or (a state dict) where match_model_names found it
    stored = (
        {
            p: n
            for (role, p), n in match_model_names(reader.index, spec, reader.location).tensors.items()
            if role == PARAM
        }
        if is_state_dict(reader.index)
        else {}
    )
    param_dtype = reader.index.tensors[stored.get(tensors[0].source, tensors[0].source)].dtype
    dtype = dtype or param_dtype
    if dtype not in ("bfloat16", "float32", "float16"):
        raise HfExportError(f"cannot export as {dtype!r}; choose bfloat16 or float32")
    torch_dtype = dtypes.to_torch(dtype)
    shards = assign_shards(tensors, dtype, max_shard_size)
    names = [shard_name(k + 1, len(shards)) for k in range(len(shards))]
    dest = _Destination(out, overwrite)
    try:
        _write(reader, spec, dest.storage, names, shards, tensors, dtype, torch_dtype, on_bytes, stored)
        dest.commit()
    except _SourceFailed as e:
        dest.abort()
        raise e.error from None
    except BaseException:
        dest.abort()
        raise
    total = sum(t.nbytes(dtype) for t in tensors)
    return ExportResult(files=tuple(names), total_size=total, num_tensors=len(tensors), dtype=dtype)


def _write(reader, spec, storage: Storage, names, shards, tensors, dtype, torch_dtype, on_bytes, stored) -> None:
    """Every shard, then ``generation_config.json``, ``config.json`` and the index, last."""
    hf = hf_module(spec)
    values: dict[str, torch.Tensor] = {}  # HF tensors of the logical tensor being written (one at a time)
    current = None
    weight_map = {}
    for name, shard in zip(names, shards):
        with storage.open_write(name) as f:
            f.write(_header(shard, dtype))
            for t in shard:
                if t.source != current:
                    try:
                        where = stored.get(t.source) or _value_source(reader, t.source, dtype)
                        full = reader.read_tensor(where).to(torch_dtype)
                    except MoeckptError as e:
                        raise _SourceFailed(e) from None
                    values = hf.export_values(t.source, full, spec.config)
                    current = t.source
                data = tensor_bytes(values.pop(t.name))
                f.write(data)
                weight_map[t.name] = name
                if on_bytes is not None:
                    on_bytes(len(data))
    total = sum(t.nbytes(dtype) for t in tensors)
    storage.write_bytes(
        "generation_config.json", _json({"_from_model_config": True, **hf.generation_config(spec.config)})
    )
    storage.write_bytes("config.json", _json(hf.to_hf_config(spec.config, dtype=dtype)))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    storage.write_bytes(INDEX_FILE, _json(index))


def _json(doc: dict) -> bytes:
    return (json.dumps(doc, indent=2) + "\n").encode()


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count, as bytes (HF's ``max_shard_size`` convention)."""
    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in units or not 0 < value < float("inf") or not 1 <= value * units[unit] <= MAX_SHARD_BYTES:
        raise HfExportError(f"--max-shard-size {text!r} is not a size such as 5GB, 500MB or 2GiB (1 byte to 1PB)")
    return int(value * units[unit])
