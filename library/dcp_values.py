"""How ``moeckpt.dcp`` stores what DCP hands it besides tensor chunks: key names and non-tensor values, without pickle.

**Keys.** DCP keys are names, not paths: ``'a//b'``, ``'/abs'``, ``'x/../y'`` or a backslash are valid keys, but a
tensor name in the index must be a safe relative path (the zarr backend makes it one). :func:`encode_key` maps
every key to a safe name, reversibly, with percent escapes (``%`` and two upper-case hex digits of a code point
below 128); :func:`decode_key` undoes it. A key that needs no escape is its own name, so the names of ordinary
keys (``model.layers.0.w``) are what they always were. The rules are in docs/format.md ("What dcp.save through
moeckpt.dcp adds").

**Values.** A non-tensor value (a step, ``param_groups``, a ``BytesIO``, a tuple holding tensors, a whole nested
dict under ``flatten_state_dict=False``) is stored as typed JSON in the index's ``train_state``: plain JSON stays
plain, and what JSON cannot say is an object with a ``"$type"`` member (a tuple, a set, a ``torch.dtype``, a
``torch.Size``, a dict with keys that are not strings). Bytes and tensors inside a value are not put into the
JSON: each becomes a *blob*, a tensor of the checkpoint's data files (``uint8`` for bytes) named
``<encoded key>/$<i>``, and the JSON refers to it by that name. Bytes are stored as bytes; nothing is pickled.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeckpt.formats.errors import StateDictError

__all__ = [
    "TYPE",
    "Blob",
    "blob_name",
    "blob_names",
    "decode_key",
    "decode_value",
    "encode_key",
    "encode_value",
    "stream_value",
]

#: the member that marks a typed value; a plain dict holding a member of this name is itself stored typed.
TYPE = "$type"

# Escaped wherever they are: the escape character itself, the blob marker, backslash, ':' (no path in an index may
# hold one, and zarr makes names paths) and control characters.
_ALWAYS = frozenset("%$\\:") | frozenset(chr(c) for c in range(0x20)) | {"\x7f"}
_ESCAPE = re.compile(r"%([0-9A-F]{2})")


def _esc(ch: str) -> str:
    return f"%{ord(ch):02X}"


def encode_key(key: str) -> str:
    """The safe tensor name of DCP key ``key``: a '/' that would start an empty part, a part that is '.' or '..',
    the '__' that starts a part and a part named like a zarr or index document are escaped, as is every '%', '$',
    ':', backslash and control character. Refuses only the empty key."""
    if not isinstance(key, str) or not key:
        raise StateDictError(f"key {key!r}: an empty key cannot be saved; give the value a name")
    out: list[str] = []
    n = len(key)
    for i, ch in enumerate(key):
        if ch in _ALWAYS:
            out.append(_esc(ch))
        elif ch == "/" and (i == 0 or i == n - 1 or key[i + 1] == "/"):
            out.append("%2F")
        else:
            out.append(ch)
    parts = "".join(out).split("/")
    for j, part in enumerate(parts):
        if part in (".", ".."):
            parts[j] = "%2E" * len(part)
        elif part.startswith("__"):
            parts[j] = "%5F" + part[1:]
        elif part == "zarr.json" or (j == 0 and part == "moeckpt.json"):
            parts[j] = part.replace(".", "%2E")
    return "/".join(parts)


def decode_key(name: str) -> str:
    """The DCP key of tensor name ``name``: every ``%XX`` escape (upper-case hex) becomes its character; anything
    else is itself (so names that were written before keys were encoded read as they were written)."""
    if "%" not in name:
        return name
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), name)


def blob_name(key: str, i: int) -> str:
    """The tensor name of blob ``i`` of the value at ``key``: no encoded key has a part that starts with '$', so a
    blob can never collide with a tensor of the state dict, nor be a zarr group of one."""
    return f"{encode_key(key)}/${i}"


@dataclass(frozen=True)
class Blob:
    """Bytes or a tensor inside a value, stored as a tensor of the data files."""

    name: str
    data: torch.Tensor  # a dense CPU tensor; bytes as a 1-d uint8 tensor


def _bytes_tensor(data: bytes | bytearray | memoryview) -> torch.Tensor:
    raw = bytes(data)
    if not raw:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def stream_value(key: str, data: bytes | bytearray | memoryview) -> tuple[Any, list[Blob]]:
    """The stored form of a byte stream a custom save planner produced (its ``transform_object``): the bytes as one
    blob, handed back unchanged to the load planner's ``load_bytes``."""
    name = blob_name(key, 0)
    return {TYPE: "stream", "blob": name}, [Blob(name, _bytes_tensor(data))]


def encode_value(key: str, value: Any) -> tuple[Any, list[Blob]]:
    """The typed JSON of ``value`` and the blobs it refers to; refuses (naming ``key``) what it cannot store."""
    blobs: list[Blob] = []

    def blob(data: torch.Tensor) -> str:
        name = blob_name(key, len(blobs))
        blobs.append(Blob(name, data))
        return name

    def enc(v: Any, depth: int) -> Any:
        if depth > 100:
            raise StateDictError(f"key {key!r}: the value nests more than 100 levels deep (or holds itself)")
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int):
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, torch.Tensor):
            return {TYPE: "tensor", "blob": blob(_dense_cpu(key, v))}
        if isinstance(v, (bytes, bytearray, memoryview)):
            kind = "bytearray" if isinstance(v, bytearray) else "bytes"
            return {TYPE: kind, "blob": blob(_bytes_tensor(v))}
        if isinstance(v, io.BytesIO):
            return {TYPE: "io.BytesIO", "blob": blob(_bytes_tensor(v.getbuffer())), "position": v.tell()}
        if isinstance(v, torch.dtype):
            return {TYPE: "torch.dtype", "name": str(v).removeprefix("torch.")}
        if isinstance(v, torch.Size):
            return {TYPE: "torch.Size", "items": [int(s) for s in v]}
        if isinstance(v, list):
            return [enc(x, depth + 1) for x in v]
        if isinstance(v, tuple) and type(v) is tuple:
            return {TYPE: "tuple", "items": [enc(x, depth + 1) for x in v]}
        if isinstance(v, (set, frozenset)):
            items = [enc(x, depth + 1) for x in v]
            items.sort(key=lambda x: json.dumps(x, sort_keys=True, allow_nan=True))  # a set has no order: one is chosen
            return {TYPE: "frozenset" if isinstance(v, frozenset) else "set", "items": items}
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and TYPE not in v:
                return {k: enc(x, depth + 1) for k, x in v.items()}
            return {TYPE: "dict", "items": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        raise StateDictError(
            f"key {key!r}: a value of type {type(v).__name__} cannot be saved: values must be tensors, numbers, "
            "strings, bytes or io.BytesIO, torch.dtype, or lists, tuples, sets and dicts of them; nothing is pickled"
        )

    return enc(value, 0), blobs


def _dense_cpu(key: str, t: torch.Tensor) -> torch.Tensor:
    from moeckpt.formats import dtypes

    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        # DTensor, ShardedTensor and other subclasses are sharded: only DCP's planner knows how to store them.
        raise StateDictError(
            f"key {key!r}: a {type(t).__name__} inside a non-tensor value cannot be saved; keep it a leaf of the "
            "state dict (DefaultSavePlanner(flatten_state_dict=True) makes nested dicts leaves)"
        )
    if t.is_sparse or t.layout != torch.strided:
        raise StateDictError(f"key {key!r}: a {t.layout} tensor cannot be saved; convert it to a dense tensor")
    try:
        dtypes.from_torch(t.dtype)
    except ValueError as e:
        raise StateDictError(f"key {key!r}: {e}") from None
    return t.detach().cpu().contiguous()


def blob_names(value: Any) -> list[str]:
    """The blobs a stored value refers to, in order."""
    out: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, list):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            if isinstance(v.get(TYPE), str) and isinstance(v.get("blob"), str):
                out.append(v["blob"])
            for x in v.values():
                walk(x)

    walk(value)
    return out


def decode_value(value: Any, read_blob: Callable[[str], torch.Tensor], where: str) -> Any:
    """The value stored as ``value`` (typed JSON), reading its blobs with ``read_blob``; a stream (a custom save
    planner's bytes) comes back as :class:`io.BytesIO`. ``where`` names the value in errors."""

    def blob(name: Any) -> torch.Tensor:
        if not isinstance(name, str):
            raise StateDictError(f"{where}: a stored value's blob is {name!r}, not a tensor name")
        return read_blob(name)

    def raw(name: Any) -> bytes:
        t = blob(name)
        if t.dtype != torch.uint8 or t.dim() != 1:
            raise StateDictError(f"{where}: blob {name!r} is {t.dtype} {list(t.shape)}, not bytes")
        return t.numpy().tobytes()

    def dec(v: Any) -> Any:
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            return v
        kind = v.get(TYPE)
        if kind is None:
            return {k: dec(x) for k, x in v.items()}
        if kind == "tuple":
            return tuple(dec(x) for x in _items(v))
        if kind == "set":
            return {dec(x) for x in _items(v)}
        if kind == "frozenset":
            return frozenset(dec(x) for x in _items(v))
        if kind == "dict":
            return {dec(k): dec(x) for k, x in _items(v)}
        if kind == "torch.Size":
            return torch.Size(int(x) for x in _items(v))
        if kind == "torch.dtype":
            dtype = getattr(torch, str(v.get("name")), None)
            if not isinstance(dtype, torch.dtype):
                raise StateDictError(f"{where}: {v.get('name')!r} is not a torch dtype")
            return dtype
        if kind == "tensor":
            return blob(v.get("blob"))
        if kind == "bytes":
            return raw(v.get("blob"))
        if kind == "bytearray":
            return bytearray(raw(v.get("blob")))
        if kind in ("io.BytesIO", "stream"):
            buf = io.BytesIO(raw(v.get("blob")))
            buf.seek(int(v.get("position", 0)))
            return buf
        raise StateDictError(f"{where}: unknown stored value type {kind!r}; a newer moeckpt wrote it")

    def _items(v: dict) -> list:
        items = v.get("items")
        if not isinstance(items, list):
            raise StateDictError(f"{where}: a stored {v.get(TYPE)} has no list of items")
        return items

    return dec(value)
