"""Plain data (dict, list, tuple, str, int, float, bool, None) written as a file ``torch.load`` reads, without
``pickle``.

Why this exists: Megatron-Core's ``dist_checkpointing.load`` reads two things with ``torch.load`` and nothing
else: ``common.pt`` (the non-sharded "common" state; it must exist) and every ``ShardedObject`` (a module's
``_extra_state``: DCP hands its bytes to ``torch.load``). A checkpoint moeckpt exports for Megatron must hold
both, and moeckpt never runs ``pickle`` (nor ``torch.save``, which is pickle). Tuples and integer keys are what
Megatron's optimizer keeps there: AdamW's ``betas`` is a tuple, and a chained optimizer's sub-optimizers are
keyed ``0``, ``1``. So this module emits the few
pickle opcodes that spell plain data, by hand, inside the zip container ``torch.save`` writes
(``<archive>/data.pkl`` plus its small records, stored uncompressed), written with :mod:`zipfile`.

What comes out is data only: no ``GLOBAL``, ``REDUCE`` or ``BUILD`` opcode, so ``torch.load(weights_only=True)``
reads it (the tests prove it), and so does any restricted unpickler. Anything but plain data is refused with a
``TypeError`` naming the value's type.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import zipfile

# The pickle opcodes used (protocol 2: what torch.save writes, and what its weights_only unpickler expects).
_PROTO_2 = b"\x80\x02"
_STOP = b"."
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_EMPTY_DICT, _EMPTY_LIST, _MARK, _SETITEMS, _APPENDS = b"}", b"]", b"(", b"u", b"e"
_BININT, _LONG1, _BINFLOAT, _BINUNICODE = b"J", b"\x8a", b"G", b"X"
#: a tuple of 0, 1, 2 or 3 items built from the stack (protocol 2); longer ones are MARK ... TUPLE.
_SHORT_TUPLES, _TUPLE = (b")", b"\x85", b"\x86", b"\x87"), b"t"
#: pickle's batching of SETITEMS/APPENDS (what pickle itself does, so a long list never needs one huge MARK).
_BATCH = 1000

#: the records torch.save puts beside ``data.pkl`` (format version 1, serialization version 3, little endian).
_RECORDS = {".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little", "version": b"3\n"}


def dumps(value: object) -> bytes:
    """The protocol-2 pickle of plain data ``value`` (dict with str or int keys, list, tuple, str, int, float, bool,
    None)."""
    out = bytearray(_PROTO_2)
    _encode(value, out, ())
    out += _STOP
    return bytes(out)


def _encode(value: object, out: bytearray, path: tuple) -> None:
    if value is None:
        out += _NONE
    elif value is True:
        out += _TRUE
    elif value is False:
        out += _FALSE
    elif type(value) is int:
        if -(2**31) <= value < 2**31:
            out += _BININT + struct.pack("<i", value)
        else:  # two's complement, little endian, as pickle's encode_long
            n = (value.bit_length() + 8) // 8
            data = value.to_bytes(n, "little", signed=True)
            if len(data) > 255:
                raise TypeError(f"plain_pickle: integer at {_where(path)} is too large")
            out += _LONG1 + bytes([len(data)]) + data
    elif type(value) is float:
        if math.isnan(value):
            value = math.nan  # one NaN bit pattern, whatever produced it
        out += _BINFLOAT + struct.pack(">d", value)
    elif type(value) is str:
        data = value.encode("utf-8", "surrogatepass")
        out += _BINUNICODE + struct.pack("<I", len(data)) + data
    elif type(value) is list:
        out += _EMPTY_LIST
        for i in range(0, len(value), _BATCH):
            out += _MARK
            for j, item in enumerate(value[i : i + _BATCH], start=i):
                _encode(item, out, (*path, j))
            out += _APPENDS
    elif type(value) is tuple:
        if len(value) >= len(_SHORT_TUPLES):
            out += _MARK
        for j, item in enumerate(value):
            _encode(item, out, (*path, j))
        out += _SHORT_TUPLES[len(value)] if len(value) < len(_SHORT_TUPLES) else _TUPLE
    elif type(value) is dict:
        out += _EMPTY_DICT
        items = list(value.items())
        for i in range(0, len(items), _BATCH):
            out += _MARK
            for k, v in items[i : i + _BATCH]:
                if type(k) is not str and type(k) is not int:
                    raise TypeError(
                        f"plain_pickle: key {k!r} at {_where(path)} is a {type(k).__name__}, not a str or an int"
                    )
                _encode(k, out, path)
                _encode(v, out, (*path, k))
            out += _SETITEMS
    else:
        raise TypeError(
            f"plain_pickle: {type(value).__name__} at {_where(path)} is not plain data "
            "(dict, list, tuple, str, int, float, bool, None)"
        )


def _where(path: tuple) -> str:
    return "the top" if not path else "".join(f"[{p!r}]" for p in path)


def torch_file(value: object, archive: str = "data") -> bytes:
    """The bytes of a file ``torch.load`` reads as plain data ``value``: the zip container of ``torch.save`` with
    ``value``'s pickle as ``<archive>/data.pkl`` and no tensor storages."""
    if not archive or "/" in archive:
        raise ValueError(f"plain_pickle: archive name {archive!r} must be one path component")
    pickled = dumps(value)
    buf = io.BytesIO()
    # ZIP_STORED: torch's reader maps records in place and refuses compressed ones.
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr(_info(f"{archive}/data.pkl"), pickled)
        for name, data in _RECORDS.items():
            zf.writestr(_info(f"{archive}/{name}"), data)
        # torch.save records a decimal id of the file; any 40 digits do, these depend on the content only
        digits = str(int(hashlib.sha1(pickled).hexdigest(), 16)).rjust(40, "0")[:40]
        zf.writestr(_info(f"{archive}/.data/serialization_id"), digits.encode())
    return buf.getvalue()


def _info(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # a fixed date: the same value, the same bytes
    info.compress_type = zipfile.ZIP_STORED
    return info
