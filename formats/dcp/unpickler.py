"""Restricted unpicklers for the two pickles a torch DCP checkpoint holds, which run no code of the file's choosing.

A DCP checkpoint's ``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``, and every tensor
item in a ``.distcp`` file is a ``torch.save`` zip whose ``data.pkl`` is a pickle too. ``pickle.load`` on either
would let the file call any importable function. Here the pickle machinery only ever builds *stand-ins*: plain
classes of this module that hold fields and validate their arguments. Nothing of torch (or any other module) is
imported or called on behalf of the file:

* :func:`find_class` admits only the names listed in ``METADATA_CLASSES`` / ``PAYLOAD_CLASSES`` (what torch 2.x's
  ``dcp.save`` and ``torch.save`` write, as read from their source and from disassembled files), and maps each to
  its stand-in; anything else is refused with one line naming it.
* Stand-ins that pickle constructs with ``NEWOBJ`` take no constructor arguments and only accept their state
  through ``BUILD``; the few that pickle *calls* (``REDUCE``: ``torch.Size``, the enums, ``PosixPath``,
  ``torch.serialization._get_layout``, ``OrderedDict``) accept only the argument types torch writes, so an admitted
  name cannot be abused as a general callable (there is no ``getattr``, ``eval`` or ``os.system`` to reach).
* Persistent ids (``torch.save``'s storages) are only accepted by the payload unpickler, as descriptors.

Before any of that, :func:`~moeckpt.formats.dcp.bounds.scan` checks the opcodes, so that what a pickle builds is
bounded by its size (memo indices, nesting, tuples that memo references expand, integer widths); every message
that quotes a value from the file shows it through :func:`~moeckpt.formats.render.bounded_repr`.
"""

from __future__ import annotations

import pickle
from typing import Any, Self

from moeckpt.formats.render import bounded_repr, bounded_text

from .bounds import UnsafePickleError, scan_bytes


class _Record:
    """A field holder built by ``NEWOBJ`` + ``BUILD``; the field names of its state are kept as attributes."""

    #: the DCP class this stands in for, for messages.
    dcp_name = "record"
    #: names of the fields when the state is a tuple (TensorProperties pickles a tuple).
    tuple_fields: tuple[str, ...] = ()

    def __new__(cls, *args: object, **kwargs: object) -> Self:
        if args or kwargs:
            raise UnsafePickleError(f"refusing to unpickle {cls.dcp_name} called with arguments: not how DCP stores it")
        return super().__new__(cls)

    def __setstate__(self, state: object) -> None:
        if (
            isinstance(state, tuple)
            and len(state) == 2
            and (state[0] is None or isinstance(state[0], dict))
            and (isinstance(state[1], dict))
        ):
            # (dict state, slot state): dataclasses with __slots__
            merged = dict(state[0] or {})
            merged.update(state[1])
            state = merged
        if isinstance(state, tuple) and self.tuple_fields and len(state) == len(self.tuple_fields):
            state = dict(zip(self.tuple_fields, state))
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise UnsafePickleError(f"refusing to unpickle {self.dcp_name}: its state is not a field dictionary")
        for key, value in state.items():
            if key.startswith("__"):
                raise UnsafePickleError(
                    f"refusing to unpickle {self.dcp_name}: field {bounded_repr(key)} is not a data field"
                )
            object.__setattr__(self, key, value)

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:  # the fields were built by a foreign file: shown bounded
        return f"{self.dcp_name}({bounded_repr(self.__dict__)})"


def _record(name: str, fields: tuple[str, ...] = ()) -> type:
    return type(name.rsplit(".", 1)[-1], (_Record,), {"dcp_name": name, "tuple_fields": fields})


class Size(tuple):
    """``torch.Size``: pickled as ``REDUCE(torch.Size, (tuple_of_ints,))``."""

    def __new__(cls, dims: object = ()) -> Self:
        if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims):
            raise UnsafePickleError(
                f"refusing to unpickle torch.Size({bounded_repr(dims)}): not a tuple of non-negative ints"
            )
        return super().__new__(cls, dims)


class DType(str):
    """A torch dtype, which pickles as a module global (``torch.float32``); the value is the dtype's name."""


class Layout(str):
    """A torch layout (``torch.strided``), pickled as ``REDUCE(torch.serialization._get_layout, ("torch.strided",))``."""


_LAYOUTS = (
    "torch.strided",
    "torch.sparse_coo",
    "torch.sparse_csr",
    "torch.sparse_csc",
    "torch.sparse_bsr",
    "torch.sparse_bsc",
    "torch._mkldnn",
    "torch.jagged",
)


def _get_layout(name: object) -> Layout:
    if name not in _LAYOUTS:
        raise UnsafePickleError(
            f"refusing to unpickle torch.serialization._get_layout({bounded_repr(name)}): not a torch layout"
        )
    return Layout(name)


def _enum(name: str, values: tuple[object, ...]) -> type:
    """An enum stand-in: ``REDUCE(EnumClass, (value,))`` returns the value if it is one of the enum's."""

    def new(cls: type, value: object) -> object:
        if value not in values or type(value) not in (int, str):
            raise UnsafePickleError(f"refusing to unpickle {name}({bounded_repr(value)}): not one of its values")
        return value

    return type(name.rsplit(".", 1)[-1], (), {"__new__": new})


#: the longest path a pickled ``pathlib`` path may join to (PATH_MAX): its parts may be one string many times over.
MAX_PATH_CHARS = 4096


class _Path(str):
    """``pathlib.PosixPath('...')`` (``StorageMeta.checkpoint_id``), kept as the joined string."""

    def __new__(cls, *parts: object) -> Self:
        strings = [p for p in parts if isinstance(p, str)]
        if len(strings) != len(parts):
            raise UnsafePickleError(f"refusing to unpickle a path of {bounded_repr(parts)}: parts must be strings")
        if sum(len(p) + 1 for p in strings) > MAX_PATH_CHARS:
            raise UnsafePickleError(f"refusing to unpickle a path longer than {MAX_PATH_CHARS} characters")
        return super().__new__(cls, "/".join(str(p) for p in strings))


class _OrderedDict(dict):
    """``collections.OrderedDict()``: built empty (items come by SETITEMS), or from a list of pairs."""

    def __new__(cls, items: object = ()) -> Self:
        out = super().__new__(cls)
        if not isinstance(items, (list, tuple)) or not all(isinstance(p, tuple) and len(p) == 2 for p in items):
            raise UnsafePickleError("refusing to unpickle collections.OrderedDict: its argument is not a list of pairs")
        dict.update(out, items)
        return out

    def __init__(self, items: object = ()) -> None:  # the items were set in __new__
        del items


#: dtype globals torch pickles by name (``torch.float32``); the stand-in is the name.
DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "complex64",
    "complex128",
    "uint16",
    "uint32",
    "uint64",
)

_DCP = "torch.distributed.checkpoint"
_META = f"{_DCP}.metadata"

#: what ``.metadata`` may name: DCP's own metadata classes (``metadata``, ``filesystem``, and the ``planner``
#: classes Megatron-Core's saver keeps in ``Metadata.all_local_plans``), ``torch.Size``, dtypes and layouts as
#: torch pickles them, paths (``StorageMeta.checkpoint_id``) and ``OrderedDict``. No builtin callable is admitted.
METADATA_CLASSES: dict[tuple[str, str], object] = {
    (_META, "Metadata"): _record(f"{_META}.Metadata"),
    (_META, "TensorStorageMetadata"): _record(f"{_META}.TensorStorageMetadata"),
    (_META, "BytesStorageMetadata"): _record(f"{_META}.BytesStorageMetadata"),
    (_META, "ChunkStorageMetadata"): _record(f"{_META}.ChunkStorageMetadata"),
    (_META, "TensorProperties"): _record(
        f"{_META}.TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    ),
    (_META, "MetadataIndex"): _record(f"{_META}.MetadataIndex"),
    (_META, "StorageMeta"): _record(f"{_META}.StorageMeta"),
    (_META, "_MEM_FORMAT_ENCODING"): _enum(f"{_META}._MEM_FORMAT_ENCODING", (0, 1, 2)),
    (f"{_DCP}.filesystem", "_StorageInfo"): _record(f"{_DCP}.filesystem._StorageInfo"),
    (f"{_DCP}.filesystem", "_StoragePrefix"): _record(f"{_DCP}.filesystem._StoragePrefix"),
    (f"{_DCP}.planner", "SavePlan"): _record(f"{_DCP}.planner.SavePlan"),
    (f"{_DCP}.planner", "WriteItem"): _record(f"{_DCP}.planner.WriteItem"),
    (f"{_DCP}.planner", "TensorWriteData"): _record(f"{_DCP}.planner.TensorWriteData"),
    (f"{_DCP}.planner", "BytesIOWriteData"): _record(f"{_DCP}.planner.BytesIOWriteData"),
    (f"{_DCP}.planner", "WriteItemType"): _enum(f"{_DCP}.planner.WriteItemType", (1, 2, 3)),
    ("torch", "Size"): Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch", "strided"): Layout("torch.strided"),
    ("torch", "contiguous_format"): "contiguous_format",
    ("pathlib", "PosixPath"): _Path,
    ("pathlib", "WindowsPath"): _Path,
    ("pathlib", "PurePosixPath"): _Path,
    ("pathlib", "Path"): _Path,
    ("collections", "OrderedDict"): _OrderedDict,
    **{("torch", name): DType(name) for name in DTYPE_NAMES},
}


class StorageRef(_Record):
    """The persistent id of a ``torch.save`` storage: ``('storage', <dtype>Storage, key, location, numel)``."""

    dcp_name = "torch.save storage"


class TensorRef(_Record):
    """What ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` would build, as a descriptor."""

    dcp_name = "torch._utils._rebuild_tensor_v2"
    #: the fields :func:`_rebuild_tensor_v2` sets (a storage descriptor, an element offset, the size and stride).
    storage: Any
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


#: sizes, strides, offsets and element counts of a stored tensor are torch int64s, never negative.
MAX_INT = 2**63 - 1


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(type(v) is int and 0 <= v <= MAX_INT for v in value):
        raise UnsafePickleError(
            f"refusing to unpickle a tensor whose {what} is {bounded_repr(value)}: not a tuple of int64s >= 0"
        )
    return tuple(value)


def _rebuild_tensor_v2(
    storage: object,
    offset: object,
    size: object,
    stride: object,
    requires_grad: object = False,
    hooks: object = None,
    metadata: object = None,
) -> TensorRef:
    if not isinstance(storage, StorageRef) or type(offset) is not int or not 0 <= offset <= MAX_INT:
        raise UnsafePickleError("refusing to unpickle _rebuild_tensor_v2 of something that is not a stored tensor")
    if not isinstance(requires_grad, bool) or (hooks is not None and not isinstance(hooks, dict)) or hooks:
        raise UnsafePickleError("refusing to unpickle _rebuild_tensor_v2 with backward hooks or a non-bool flag")
    ref = TensorRef()
    ref.__setstate__(
        {"storage": storage, "offset": offset, "size": _ints(size, "size"), "stride": _ints(stride, "stride")}
    )
    return ref


#: storage classes ``torch.save`` names (``torch.FloatStorage``), mapped to the dtype they hold.
STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "Float8_e4m3fnStorage": "float8_e4m3fn",
    "Float8_e5m2Storage": "float8_e5m2",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}


class StorageType(str):
    """A ``torch.<Dtype>Storage`` class named by a payload; the value is the dtype name."""


#: what a tensor item's ``data.pkl`` may name: the tensor rebuild function (as a descriptor builder), the storage
#: classes, ``OrderedDict`` (the empty backward-hooks argument). Nothing else: a payload is one tensor.
PAYLOAD_CLASSES: dict[tuple[str, str], object] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("collections", "OrderedDict"): _OrderedDict,
    **{("torch", name): StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()},
}


class _Input:
    """A file over the pickle's bytes without copying them (``io.BytesIO`` copies a ``bytearray``): what the
    C unpickler reads (``peek`` lets it read ahead in blocks instead of one call per opcode)."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._data = data
        self._view = memoryview(data)
        self._pos = 0

    def peek(self, n: int = 1) -> bytes:
        return bytes(self._view[self._pos : self._pos + max(1, n)])

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        out = bytes(self._view[self._pos : end])
        self._pos = end
        return out

    def readinto(self, out: memoryview | bytearray) -> int:
        n = min(len(out), len(self._view) - self._pos)
        memoryview(out).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def readline(self) -> bytes:
        end = self._data.find(b"\n", self._pos)
        return self.read(-1 if end < 0 else end + 1 - self._pos)


class _Restricted(pickle.Unpickler):
    def __init__(
        self, data: bytes | bytearray, allowed: dict[tuple[str, str], object], where: str, persistent: bool
    ) -> None:
        super().__init__(_Input(data))
        self._allowed = allowed
        self._where = where
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            named = f"{bounded_text(module)}.{bounded_text(name)}"
            raise UnsafePickleError(
                f"{self._where}: refusing to unpickle {named} from {self._kind()}: not a DCP metadata class"
                if not self._persistent
                else f"{self._where}: refusing to unpickle {named} from a tensor payload: not a stored tensor"
            ) from None

    def _kind(self) -> str:
        return ".metadata"

    def persistent_load(self, pid: object) -> object:
        if not self._persistent:
            raise UnsafePickleError(f"{self._where}: refusing a persistent id in .metadata: DCP metadata has none")
        if (
            not isinstance(pid, tuple)
            or len(pid) != 5
            or pid[0] != "storage"
            or not isinstance(pid[1], StorageType)
            or not isinstance(pid[2], str)
            or not isinstance(pid[3], str)
            or type(pid[4]) is not int
            or not 0 <= pid[4] <= MAX_INT
        ):
            raise UnsafePickleError(
                f"{self._where}: refusing persistent id {bounded_repr(pid)}: not a torch.save storage"
            )
        ref = StorageRef()
        ref.__setstate__({"dtype": str(pid[1]), "key": pid[2], "location": pid[3], "numel": pid[4]})
        return ref


def _load(data: bytes | bytearray, allowed: dict, where: str, persistent: bool, scanned: bool = False) -> object:
    # What the pickle may build is bounded first (memo indices, nesting, tuple expansion, integer widths), then the
    # restricted unpickler decides what it may name.
    try:
        if not scanned:
            scan_bytes(data, where, persistent=persistent)
        return _Restricted(data, allowed, where, persistent).load()
    except UnsafePickleError:
        raise
    except RecursionError:
        raise UnsafePickleError(f"{where}: refusing a pickle nested too deeply to be DCP metadata") from None
    except MemoryError:
        raise UnsafePickleError(f"{where}: refusing a pickle that does not fit in memory") from None
    except Exception as e:  # noqa: BLE001 - a truncated or garbage pickle raises anything (EOFError, KeyError, ...)
        raise UnsafePickleError(
            f"{where}: not a readable pickle ({type(e).__name__}: {bounded_text(' '.join(str(e).split()), 200)}); "
            "the file is corrupt"
        ) from None


def load_metadata_pickle(data: bytes | bytearray, where: str, *, scanned: bool = False) -> object:
    """Unpickle ``.metadata`` bytes into stand-ins (never torch objects); refuses anything DCP does not write, and
    any pickle whose opcodes break a bound of :mod:`~moeckpt.formats.dcp.bounds`, before building anything
    (``scanned``: the bytes are what :func:`~moeckpt.formats.dcp.bounds.scan` returned, not to be scanned again)."""
    return _load(data, METADATA_CLASSES, where, persistent=False, scanned=scanned)


def load_payload_pickle(data: bytes, where: str) -> object:
    """Unpickle a tensor item's ``data.pkl`` into a :class:`TensorRef` descriptor; refuses anything else."""
    return _load(data, PAYLOAD_CLASSES, where, persistent=True)
