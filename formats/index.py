"""The checkpoint index, ``moeckpt.json``: what a checkpoint holds, written last as its commit.

The index lists every logical tensor (name, global shape, dtype, role, sharding rule) and every data file
(size and header checksum). It does not list pieces: those are named in each data file's own header, so the
index grows with the number of tensors and files, never with the number of pieces. The sharding rule and the
layout are stored as plain JSON; the format layer validates their shape, ``moeckpt.reshard`` gives them meaning.
See ``docs/format.md`` for the versioned specification.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from . import dtypes
from .backend import backend_compressions, backend_names
from .checksum import is_checksum
from .compression import NONE, check_compress
from .errors import CheckpointIndexError, UnsafePathError, UnsupportedVersionError
from .pieces import CHECKSUM_BLOCK_BYTES
from .roles import ROLES
from .slices import tensor_sliced

INDEX_NAME = "moeckpt.json"
FORMAT_NAME = "moeckpt"
#: the newest version this moeckpt reads; it writes 1 unless the index needs what a later version added.
FORMAT_VERSION = 5
#: the version an index with device-mesh shardings (or stored-piece shardings) is written as.
MESH_FORMAT_VERSION = 2
#: the version an index is written as when its tensor names are escaped DCP keys (``model.config.dcp``, written
#: by ``moeckpt.dcp.StorageWriter``) or a tensor has a dtype version 3 added: a version-2 reader would take the
#: escaped names for keys, or fail on the dtype.
DCP_FORMAT_VERSION = 3
#: the version an index is written as when its data files may be compressed (member ``compress``, not ``none``):
#: a reader of version 3 would take a compressed zarr chunk for a raw one and refuse it as the wrong length.
COMPRESS_FORMAT_VERSION = 4
#: the version a safetensors index is written as when a tensor's pieces are checksummed in column slices along its
#: TP dimension (:mod:`~moeckpt.formats.slices`): a reader of version 4 would refuse their checksum counts.
SLICED_FORMAT_VERSION = 5
#: the member of ``model.config`` that says the tensor names are escaped DCP keys and holds DCP's own metadata.
DCP_CONFIG_KEY = "dcp"
#: the sharding of a tensor whose pieces, and the files holding them, only the data files' headers list (no rule
#: computes them): what ``dcp.save`` through ``moeckpt.dcp.StorageWriter`` and ``import-dcp --mapping none`` write.
STORED_SHARDING: dict[str, Any] = {"pieces": "stored"}


def check_relative_path(path: object, where: str) -> str:
    """Refuse any recorded path that could escape the checkpoint directory."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{where}: a file path must be a non-empty string, got {path!r}")
    parts = path.split("/")
    if (
        path.startswith(("/", "\\"))
        or "\\" in path
        or ":" in path
        or any(p in ("", ".", "..") for p in parts)
        or "\x00" in path
    ):
        raise UnsafePathError(
            f"{where}: path {path!r} is not a plain relative path inside the checkpoint "
            "(no '..', no absolute paths, no drive letters or URL schemes); the index is corrupt or hostile"
        )
    return path


#: what makes a tensor name unsafe: a leading ``/``, a backslash, a control character, or an empty, ``.`` or ``..``
#: ``/``-separated part (one search per name: a save checks thousands).
_UNSAFE_NAME = re.compile(r"^/|\\|[\x00-\x1f\x7f]|(?:^|/)\.{0,2}(?:/|$)")


@functools.lru_cache(maxsize=1 << 16)
def _is_safe_name(name: str) -> bool:
    # Remembered: every save and every index read checks the same thousands of names again.
    return _UNSAFE_NAME.search(name) is None


def check_tensor_name(name: object, where: str) -> str:
    """Refuse a tensor name that could not be a path component sequence inside a checkpoint.

    Names become paths in the zarr backend (``exp_avg/model.layers.0.w`` is a zarr group and an array), so a name
    with a ``..``, ``.`` or empty component, a leading ``/``, a backslash or a control character could escape the
    checkpoint or collide; such a name is refused on write and on read alike.
    """
    if not isinstance(name, str) or not name:
        raise UnsafePathError(f"{where}: a tensor name must be a non-empty string, got {name!r}")
    if not _is_safe_name(name):
        raise UnsafePathError(
            f"{where}: tensor name {name!r} is not a safe name (no '..', '.' or empty '/'-separated parts, no leading "
            "'/', backslash or control character); rename the key"
        )
    return name


@dataclass(frozen=True)
class MeshEntry:
    """A device mesh: the global ranks of an n-d grid, row-major (what ``DeviceMesh.mesh`` holds)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.shape or any(type(n) is not int or n < 1 for n in self.shape):
            raise CheckpointIndexError(f"mesh shape {list(self.shape)} must be a non-empty list of positive integers")
        if len(self.ranks) != math.prod(self.shape):
            raise CheckpointIndexError(
                f"mesh of shape {list(self.shape)} lists {len(self.ranks)} ranks, not {math.prod(self.shape)}"
            )
        if any(type(r) is not int or r < 0 for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise CheckpointIndexError("mesh ranks must be distinct non-negative integers")

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "ranks": list(self.ranks)}

    @classmethod
    def from_json(cls, value: object, where: str) -> MeshEntry:
        if not isinstance(value, dict) or set(value) != {"shape", "ranks"}:
            raise CheckpointIndexError(f'{where}: a mesh is {{"shape": [...], "ranks": [...]}}, got {value!r}')
        shape, ranks = value["shape"], value["ranks"]
        if not isinstance(shape, list) or not isinstance(ranks, list):
            raise CheckpointIndexError(f"{where}: mesh 'shape' and 'ranks' must be lists")
        try:
            return cls(tuple(shape), tuple(ranks))
        except CheckpointIndexError as e:
            raise CheckpointIndexError(f"{where}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One logical tensor: layout-independent name, global shape, dtype, role and sharding rule."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    #: ``param`` (model weight), ``master`` (fp32 master copy), ``exp_avg``/``exp_avg_sq`` (AdamW moments),
    #: ``momentum`` (Muon's momentum buffer), ``buffer``.
    role: str
    #: the model parameter this tensor belongs to (equal to ``name`` for ``role == "param"``).
    param: str
    #: JSON description of how the tensor is split across ranks (interpreted by ``moeckpt.reshard``): a layout
    #: rule (``tp``, ``expert_dim``) or a device-mesh sharding (``mesh``: an index into :attr:`Index.meshes`,
    #: ``placements``).
    sharding: dict[str, Any] = field(default_factory=dict)
    #: the device mesh a mesh sharding refers to (resolved from the index's mesh table), else ``None``.
    mesh: MeshEntry | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def sharding_key(self) -> str:
        """The sharding rule as canonical JSON: a hashable key equal for tensors sharded alike (computed once; the
        planner looks it up for every box of every rank)."""
        return json.dumps(self.sharding, sort_keys=True)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "role": self.role,
            "param": self.param,
            "sharding": self.sharding,
        }

    @classmethod
    def from_json(cls, name: str, value: object, meshes: tuple[MeshEntry, ...] = ()) -> TensorEntry:
        where = f"tensor {name!r}"
        check_tensor_name(name, "index")
        if not isinstance(value, dict):
            raise CheckpointIndexError(f"{where}: expected an object, got {type(value).__name__}")
        shape = value.get("shape")
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise CheckpointIndexError(f"{where}: 'shape' must be a list of non-negative integers, got {shape!r}")
        role = value.get("role")
        if role not in ROLES:
            raise CheckpointIndexError(f"{where}: unknown role {role!r}; known: {', '.join(ROLES)}")
        param = value.get("param")
        if not isinstance(param, str) or not param:
            raise CheckpointIndexError(f"{where}: 'param' must name the parameter this tensor belongs to")
        sharding = value.get("sharding", {})
        if not isinstance(sharding, dict):
            raise CheckpointIndexError(f"{where}: 'sharding' must be an object, got {sharding!r}")
        mesh = None
        if "mesh" in sharding:
            ref = sharding["mesh"]
            if type(ref) is not int or not 0 <= ref < len(meshes):
                raise CheckpointIndexError(
                    f"{where}: sharding names mesh {ref!r}, but the index lists {len(meshes)} mesh(es)"
                )
            if set(sharding) != {"mesh", "placements"} or not isinstance(sharding["placements"], list):
                raise CheckpointIndexError(f'{where}: a mesh sharding is {{"mesh": int, "placements": [...]}}')
            mesh = meshes[ref]
        return cls(
            name=name,
            shape=tuple(shape),
            dtype=dtypes.check_dtype_name(value.get("dtype"), where),
            role=role,
            param=param,
            sharding=sharding,
            mesh=mesh,
        )


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    """One data file (or, for zarr, one stored object group) with its size and header checksum."""

    path: str
    size: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "checksum": self.checksum}


@dataclass(frozen=True, kw_only=True)
class Index:
    """The whole ``moeckpt.json``."""

    backend: str
    step: int
    #: the parallel layout that wrote the checkpoint, e.g. ``{"tp": 2, "ep": 2, "dp": 4}``.
    layout: dict[str, int]
    #: ``{"arch": "zaya", "config": {...}}``: enough to rebuild the model.
    model: dict[str, Any]
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    #: step, consumed samples, scheduler, data position, seeds: whatever the trainer needs to continue.
    train_state: dict[str, Any] = field(default_factory=dict)
    #: the device meshes that mesh shardings refer to by position (format version 2).
    meshes: tuple[MeshEntry, ...] = ()
    #: the version the index was read as (or is written as: see :attr:`written_version`).
    format_version: int = 1
    #: the compression setting the checkpoint was written with (:mod:`~moeckpt.formats.compression`, version 4);
    #: what each array stores is in its own metadata, so a reader does not need this to decode.
    compress: str = NONE

    def __post_init__(self) -> None:
        if self.backend not in backend_names():
            raise CheckpointIndexError(f"index: unknown backend {self.backend!r}; known: {', '.join(backend_names())}")
        check_compress(self.compress, "index")
        if self.compress != NONE and self.compress not in backend_compressions(self.backend):
            raise CheckpointIndexError(
                f"index: compress {self.compress!r} with backend {self.backend!r}, which stores bytes raw"
            )
        for entry in self.tensors.values():
            ref = entry.sharding.get("mesh")
            if ref is not None and (
                type(ref) is not int or not 0 <= ref < len(self.meshes) or entry.mesh != self.meshes[ref]
            ):
                raise CheckpointIndexError(f"index: tensor {entry.name!r} refers to mesh {ref!r} of its mesh table")

    @property
    def dcp_names(self) -> bool:
        """Whether the tensor names are escaped DCP keys (``model.config.dcp``, version 3): only then does a
        ``%XX`` in a name stand for a character."""
        config = self.model.get("config")
        return isinstance(config, dict) and DCP_CONFIG_KEY in config and self.written_version >= DCP_FORMAT_VERSION

    @property
    def written_version(self) -> int:
        """The format version this index is written as: 4 when it was written compressed (``compress`` is not
        ``none``); else 3 when its names are escaped DCP keys or a tensor has a dtype of version 3; else 2 when it
        has device meshes or stored-piece shardings (a version-1 reader could not locate those tensors' pieces);
        else 1. Before all of them, 5 when the backend is safetensors and the pieces of a tensor in this layout are
        checksummed in slices (:func:`~moeckpt.formats.slices.tensor_sliced`)."""
        if self.sliced:
            return SLICED_FORMAT_VERSION
        if self.compress != NONE:
            return COMPRESS_FORMAT_VERSION
        config = self.model.get("config")
        if (isinstance(config, dict) and DCP_CONFIG_KEY in config) or any(
            dtypes.since_version(e.dtype) >= DCP_FORMAT_VERSION for e in self.tensors.values()
        ):
            return DCP_FORMAT_VERSION
        if self.meshes or any(e.sharding == STORED_SHARDING for e in self.tensors.values()):
            return MESH_FORMAT_VERSION
        return 1

    @property
    def sliced(self) -> bool:
        """Whether some tensor's pieces are checksummed in column slices (format version 5: safetensors only)."""
        if self.backend != "safetensors":
            return False
        tp = self.layout.get("tp", 1) if isinstance(self.layout, dict) else 1
        return any(
            tensor_sliced(e.shape, e.sharding, tp, dtypes.itemsize(e.dtype), CHECKSUM_BLOCK_BYTES)
            for e in self.tensors.values()
        )

    @property
    def nbytes(self) -> int:
        """Logical bytes of all tensors (what a single unsharded copy would take)."""
        return sum(t.nbytes for t in self.tensors.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.written_version,
            "backend": self.backend,
            **({"compress": self.compress} if self.compress != NONE else {}),
            "step": self.step,
            "layout": self.layout,
            "model": self.model,
            "train_state": self.train_state,
            **({"meshes": [m.to_json() for m in self.meshes]} if self.meshes else {}),
            "tensors": {n: t.to_json() for n, t in sorted(self.tensors.items())},
            "files": {p: f.to_json() for p, f in sorted(self.files.items())},
        }

    def dumps(self) -> bytes:
        """Compact JSON with one tensor and one file per line: small at scale, still readable with ``less``."""
        doc = self.to_json()
        compact = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731
        lines = []
        for key, value in doc.items():
            if key == "meshes":
                inner = ",\n".join(f"  {compact(m)}" for m in value)
                lines.append(f" {compact(key)}:[\n{inner}\n ]")
            elif key in ("tensors", "files") and value:
                inner = ",\n".join(f"  {compact(k)}:{compact(v)}" for k, v in value.items())
                lines.append(f" {compact(key)}:{{\n{inner}\n }}")
            else:
                lines.append(f" {compact(key)}:{compact(value)}")
        return ("{\n" + ",\n".join(lines) + "\n}\n").encode()

    @classmethod
    def loads(cls, data: bytes, where: str) -> Index:
        """Parse and validate index bytes; ``where`` names the location in error messages."""
        try:
            doc = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointIndexError(f"{where}: index is not valid JSON ({e}); the checkpoint is corrupt") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointIndexError(f'{where}: not a moeckpt index (no "format": "moeckpt")')
        version = doc.get("format_version")
        if type(version) is not int:
            raise CheckpointIndexError(f"{where}: 'format_version' must be an integer, got {version!r}")
        if version > FORMAT_VERSION or version < 1:
            raise UnsupportedVersionError(
                f"{where}: format version {version} is not supported by this moeckpt (reads 1..{FORMAT_VERSION}); "
                "upgrade moeckpt to read it"
            )
        step = doc.get("step")
        if type(step) is not int or step < 0:
            raise CheckpointIndexError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
        layout = doc.get("layout")
        if not isinstance(layout, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 1 for k, v in layout.items()
        ):
            raise CheckpointIndexError(f"{where}: 'layout' must map names to positive integers, got {layout!r}")
        model = doc.get("model")
        if (
            not isinstance(model, dict)
            or not isinstance(model.get("arch"), str)
            or not isinstance(model.get("config", {}), dict)
        ):
            raise CheckpointIndexError(f'{where}: \'model\' must be {{"arch": str, "config": {{...}}}}')
        train_state = doc.get("train_state", {})
        if not isinstance(train_state, dict):
            raise CheckpointIndexError(f"{where}: 'train_state' must be an object")
        tensors_doc = doc.get("tensors")
        files_doc = doc.get("files")
        if not isinstance(tensors_doc, dict) or not isinstance(files_doc, dict):
            raise CheckpointIndexError(f"{where}: 'tensors' and 'files' must be objects")
        meshes_doc = doc.get("meshes", [])
        if version < MESH_FORMAT_VERSION and "meshes" in doc:
            raise CheckpointIndexError(f"{where}: 'meshes' appear in format version {version}; they need version 2")
        if not isinstance(meshes_doc, list):
            raise CheckpointIndexError(f"{where}: 'meshes' must be a list")
        meshes = tuple(MeshEntry.from_json(m, f"{where}: mesh {i}") for i, m in enumerate(meshes_doc))
        if version < DCP_FORMAT_VERSION and DCP_CONFIG_KEY in model.get("config", {}):
            raise CheckpointIndexError(
                f"{where}: 'model.config.{DCP_CONFIG_KEY}' appears in format version {version}; it needs version "
                f"{DCP_FORMAT_VERSION}"
            )
        tensors = {}
        for name, value in tensors_doc.items():
            try:
                tensors[name] = TensorEntry.from_json(name, value, meshes)
            except CheckpointIndexError as e:
                raise CheckpointIndexError(f"{where}: {e}") from None
            since = dtypes.since_version(tensors[name].dtype)
            if since > version:
                raise CheckpointIndexError(
                    f"{where}: tensor {name!r} has dtype {tensors[name].dtype}, which needs format version {since}, "
                    f"in a version-{version} index"
                )
        files = {}
        for path, value in files_doc.items():
            check_relative_path(path, f"{where}: file entry")
            if (
                not isinstance(value, dict)
                or type(value.get("size")) is not int
                or value["size"] < 0
                or not is_checksum(value.get("checksum"))
            ):
                raise CheckpointIndexError(
                    f"{where}: file {path!r} needs a non-negative integer 'size' and an 'xxh3_64:...' 'checksum'"
                )
            files[path] = FileEntry(path=path, size=value["size"], checksum=value["checksum"])
        backend = doc.get("backend")
        if backend not in backend_names():
            raise CheckpointIndexError(f"{where}: unknown backend {backend!r}; known: {', '.join(backend_names())}")
        compress = doc.get("compress", NONE)
        if "compress" in doc and version < COMPRESS_FORMAT_VERSION:
            raise CheckpointIndexError(
                f"{where}: 'compress' appears in format version {version}; it needs version {COMPRESS_FORMAT_VERSION}"
            )
        check_compress(compress, where)
        return cls(
            backend=backend,
            step=step,
            layout=dict(layout),
            model=model,
            tensors=tensors,
            files=files,
            train_state=train_state,
            meshes=meshes,
            format_version=version,
            compress=compress,
        )
