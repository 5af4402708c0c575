"""Import a Hugging Face model directory (local or URL) as a training checkpoint in any layout.

The inverse of :mod:`moeckpt.trainer.hf_export`. The directory is checked before anything is written: its
``config.json`` must name a supported architecture, every shard its index names must exist, every shard header
must hold exactly the tensors the index maps to it, and the tensors must make up the model the config describes.
Tensors are read by byte range, a chunk of rows at a time, and streamed into the checkpoint's files, so memory
stays a few chunks whatever the model's size. MoE experts may be stored per expert (``save_pretrained``, the
Hub's checkpoints) or fused (transformers 5's state dicts); the family's mapping makes either the plan's fused
tensors. The checkpoint gets fresh optimizer state (zero AdamW moments, step 0), as an optimizer starting on it
has; parameters the plan marks untrained (routing correction biases) get none.
"""

from __future__ import annotations

import importlib
import json
import struct
from collections.abc import Callable

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import Index
from moeckpt.formats.roles import MASTER, MOMENT_ROLES
from moeckpt.formats.storages import open_storage
from moeckpt.reshard.executor import write_rows
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.options import offline_options
from moeckpt.reshard.tensors import logical_tensors

from .hf_export import INDEX_FILE, hf_module
from .models import ARCHITECTURES, HF_MODEL_TYPES, ModelSpec

SINGLE_FILE = "model.safetensors"


class HfFormatError(MoeckptError, ValueError):
    """A Hugging Face directory that cannot be imported: missing files, inconsistent index, unknown model."""


class HfDirectory:
    """Read access to a Hugging Face model directory: its config, its tensors' names, and each tensor by range."""

    def __init__(self, location: str) -> None:
        self.storage = open_storage(location)
        self.location = self.storage.location
        self.config = self._read_json("config.json")
        if self.storage.exists(INDEX_FILE):
            weight_map = self._read_json(INDEX_FILE).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HfFormatError(f"{self.storage.path(INDEX_FILE)}: no 'weight_map' object")
        elif self.storage.exists(SINGLE_FILE):
            weight_map = None
        else:
            raise HfFormatError(f"{self.location}: neither {INDEX_FILE} nor {SINGLE_FILE}; not a safetensors model")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE_FILE]
        #: tensor name -> (file, dtype name, shape, absolute start, absolute end)
        self.entries: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        for f in files:
            header = self._read_header(f)
            if weight_map is not None:
                mapped = {n for n, g in weight_map.items() if g == f}
                if set(header) != mapped:
                    extra, absent = sorted(set(header) - mapped), sorted(mapped - set(header))
                    raise HfFormatError(
                        f"{self.storage.path(f)}: does not match {INDEX_FILE}: "
                        + "; ".join(
                            x
                            for x in (
                                f"the index maps {absent[:3]} here but the file lacks them" if absent else "",
                                f"the file holds {extra[:3]} the index maps elsewhere or not at all" if extra else "",
                            )
                            if x
                        )
                    )
            self.entries.update(header)

    def _read_json(self, relpath: str) -> dict:
        if not self.storage.exists(relpath):
            raise HfFormatError(f"{self.storage.path(relpath)}: missing")
        try:
            doc = json.loads(self.storage.read_bytes(relpath))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HfFormatError(f"{self.storage.path(relpath)}: not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise HfFormatError(f"{self.storage.path(relpath)}: expected a JSON object")
        return doc

    def _read_header(self, relpath: str) -> dict:
        where = self.storage.path(relpath)
        if not self.storage.exists(relpath):
            raise HfFormatError(f"{where}: shard listed in {INDEX_FILE} is missing")
        size = self.storage.size(relpath)
        if size < 8:
            raise HfFormatError(f"{where}: truncated ({size} bytes), not a safetensors file")
        (hlen,) = struct.unpack("<Q", bytes(self.storage.read_range(relpath, 0, 8)))
        if 8 + hlen > size:
            raise HfFormatError(f"{where}: header length {hlen} runs past the end of the {size}-byte file")
        try:
            doc = json.loads(bytes(self.storage.read_range(relpath, 8, 8 + hlen)))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HfFormatError(f"{where}: safetensors header is not valid JSON ({e})") from None
        out = {}
        for name, info in doc.items():
            if name == "__metadata__":
                continue
            try:
                dtype = dtypes.from_safetensors(info["dtype"])
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise HfFormatError(f"{where}: malformed header entry for {name!r}") from None
            if dtype is None:
                raise HfFormatError(f"{where}: {name} has unsupported dtype {info['dtype']!r}")
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtypes.itemsize(dtype) or 8 + hlen + end > size:
                raise HfFormatError(
                    f"{where}: {name} has data offsets {[begin, end]} that do not fit its shape or the file"
                )
            out[name] = (relpath, dtype, shape, 8 + hlen + begin, 8 + hlen + end)
        return out

    def names(self) -> set[str]:
        return set(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name``."""
        return self.read_rows(name, 0, None)

    def read_rows(self, name: str, r0: int, r1: int | None) -> torch.Tensor:
        """Rows ``[r0, r1)`` of tensor ``name`` (``r1`` None: to the end; a 0-d tensor whole), one ranged read."""
        relpath, dtype, shape, start, end = self.entries[name]
        torch_dtype = dtypes.to_torch(dtype)
        if not shape:
            rows_shape, lo, hi = shape, start, end
        else:
            r1 = shape[0] if r1 is None else min(r1, shape[0])
            row = (end - start) // shape[0] if shape[0] else 0
            rows_shape, lo, hi = (max(0, r1 - r0),) + shape[1:], start + r0 * row, start + max(r0, r1) * row
        if lo == hi:
            return torch.empty(rows_shape, dtype=torch_dtype)
        raw = self.storage.read_range(relpath, lo, hi)
        return torch.frombuffer(raw, dtype=torch.uint8).view(torch_dtype).reshape(rows_shape)


def spec_of(hf_dir: HfDirectory) -> ModelSpec:
    """Our model from the directory's ``config.json``."""
    model_type = hf_dir.config.get("model_type")
    arch = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise HfFormatError(
            f"{hf_dir.location}: model_type {model_type!r} is not supported; supported: {', '.join(HF_MODEL_TYPES)}"
        )
    mapping = importlib.import_module(f"{ARCHITECTURES[arch].__name__}.hf")
    try:
        cfg = mapping.from_hf_config(hf_dir.config)
    except (TypeError, ValueError, KeyError) as e:
        raise HfFormatError(f"{hf_dir.location}/config.json: {e}") from None
    with_tensors = getattr(mapping, "with_tensors", None)  # a family whose optional blocks the files tell
    if with_tensors is not None:
        cfg = with_tensors(cfg, {n: hf_dir.shape(n) for n in hf_dir.names()})
    return ModelSpec(arch, cfg)


def read_params(hf_dir: HfDirectory, spec: ModelSpec) -> Callable[[str, int, int], torch.Tensor]:
    """Check the directory holds exactly the model's tensors, in the shapes the config implies; returns a reader
    of rows ``[r0, r1)`` of plan tensors by name."""
    hf = hf_module(spec)
    available = hf_dir.names()
    shapes = {p.name: tuple(p.shape) for p in spec.param_specs()}
    used: set[str] = set()
    assembled = []  # plan tensors made of several HF tensors (per-expert Qwen matrices)
    shaped = getattr(hf, "import_source_shapes", None)  # a mapping that knows each source's shape
    for name, want in shapes.items():
        sources = hf.import_sources(name, spec.config, available)
        missing = [s for s in sources if s not in available]
        if missing:
            raise HfFormatError(f"{hf_dir.location}: tensor {missing[0]} of the {spec.arch} model is missing")
        used.update(sources)
        if shaped is not None:  # every source's shape checked before anything is written
            for source, shape in shaped(name, want, spec.config, available):
                if hf_dir.shape(source) != tuple(shape):
                    raise HfFormatError(
                        f"{hf_dir.location}: {source} has shape {list(hf_dir.shape(source))}, config.json implies "
                        f"{list(shape)}"
                    )
        elif sources != [name]:
            assembled.append(name)
        elif hf_dir.shape(name) != want:  # shapes are checked before anything is written
            raise HfFormatError(
                f"{hf_dir.location}: {name} has shape {list(hf_dir.shape(name))}, config.json implies {list(want)}"
            )
    extra = available - used
    if spec.config.tie_word_embeddings:
        extra.discard("lm_head.weight")  # some writers store the tied head too; it is the embedding
    if extra:
        raise HfFormatError(
            f"{hf_dir.location}: {len(extra)} tensors the {spec.arch} model does not have, e.g. {sorted(extra)[:3]}; "
            "does config.json describe these weights?"
        )

    def read_rows(name: str, r0: int, r1: int) -> torch.Tensor:
        want = shapes[name]
        if want and r1 <= r0:
            return torch.empty((0,) + want[1:])
        value = hf.import_rows(name, spec.config, available, hf_dir.read_rows, r0, r1)
        expect = (r1 - r0,) + want[1:] if want else want
        if tuple(value.shape) != expect:
            raise HfFormatError(
                f"{hf_dir.location}: rows {r0}:{r1} of {name} have shape {list(value.shape)}, config.json implies "
                f"{list(expect)} (the tensor is {list(want)})"
            )
        return value

    for name in assembled:  # an assembled tensor's shape is checked by assembling its first row
        if shapes[name]:
            read_rows(name, 0, 1)
    return read_rows


class HfImport:
    """A checked Hugging Face directory and the checkpoint it becomes: ``index`` is what :meth:`write` commits."""

    def __init__(
        self,
        hf_location: str,
        *,
        layout: Layout,
        backend: str = "safetensors",
        dtype: str = "float32",
        compress: str = NONE,
    ):
        get_backend(backend, compress=compress)  # a format that cannot compress is refused before any read
        self.hf_dir = HfDirectory(hf_location)
        self.spec = spec_of(self.hf_dir)
        self.spec.check_layout(layout.tp, layout.ep)
        self.layout = layout
        self._read = read_params(self.hf_dir, self.spec)
        untrained = self.spec.untrained()
        roles = ([MASTER] if dtype != "float32" else []) + list(MOMENT_ROLES)
        tensors = logical_tensors(
            self.spec.param_specs(),
            param_dtype=dtype,
            with_optimizer=True,
            optimizer_roles=lambda name: () if name in untrained else roles,
        )
        self.index = Index(
            backend=backend,
            compress=compress,
            step=0,
            layout=Layout().to_json(),
            model=self.spec.to_json(),
            tensors=tensors,
            files={},
            train_state={"step": 0, "imported_from": self.hf_dir.location},
        )

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of logical tensor ``name``: HF values for parameters and master weights (in the
        entry's dtype), zeros for the AdamW moments (an optimizer starting on these weights has zero moments)."""
        entry = self.index.tensors[name]
        shape = (r1 - r0,) + entry.shape[1:] if entry.shape else entry.shape
        if entry.role in MOMENT_ROLES:
            return torch.zeros(shape, dtype=dtypes.to_torch(entry.dtype))
        return self._read(entry.param, r0, r1).to(dtypes.to_torch(entry.dtype))

    def write(
        self,
        dst: str,
        *,
        overwrite: bool = False,
        workers: int | None = None,
        on_bytes: Callable[[int], None] | None = None,
        **limits: int,
    ) -> Index:
        """Write and commit the checkpoint at ``dst``, streaming: memory is a few row chunks, not the model.
        ``limits`` are the other fields of :class:`~moeckpt.reshard.options.ReshardOptions` (``chunk_bytes``, ...)."""
        return write_rows(
            dst,
            self.index,
            self.layout,
            self.read_rows,
            source_name=self.hf_dir.location,
            overwrite=overwrite,
            on_bytes=on_bytes,
            options=offline_options(workers, **limits),
        )


def import_hf(
    hf_location: str,
    dst: str,
    *,
    layout: Layout,
    backend: str = "safetensors",
    dtype: str = "float32",
    overwrite: bool = False,
    workers: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    compress: str = NONE,
) -> Index:
    """Write the Hugging Face model at ``hf_location`` as a checkpoint at ``dst`` in ``layout``, with fresh
    optimizer state; ``dtype`` is the parameter dtype (``float32`` or ``bfloat16``, whose fp32 master copy is the
    HF values in fp32), ``compress`` the compression setting. Tensors are streamed in row chunks: memory does not
    grow with the model."""
    job = HfImport(hf_location, layout=layout, backend=backend, dtype=dtype, compress=compress)
    return job.write(dst, overwrite=overwrite, workers=workers, on_bytes=on_bytes)
