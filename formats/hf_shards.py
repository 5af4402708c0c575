"""Hugging Face's sharded safetensors directory, written tensor by tensor and committed like a checkpoint.

The layout ``transformers`` (``save_pretrained`` / ``from_pretrained``) and DCP's consolidation use:
``model-0000k-of-0000n.safetensors`` shards of at most a byte budget each, every shard a safetensors file of
whole tensors (``__metadata__`` ``{"format": "pt"}``), and ``model.safetensors.index.json``
(``{"metadata": {"total_parameters": elements, "total_size": bytes}, "weight_map": {name: shard}}``, as
transformers 5 writes it), written last.

Names, dtypes and shapes are known before any byte is written, so each shard's header goes first and each
tensor's bytes are streamed after it, in whatever pieces the caller produces (a whole tensor, or runs of its
rows): the writer holds none of them. It checks that each tensor gets exactly the bytes its header promised.
Two callers: ``moeckpt export-hf`` (a bundled model's Hugging Face tensors, ``trainer/hf_export.py``) and
``moeckpt consolidate`` (any checkpoint's tensors under their own names, ``library/consolidate.py``).
"""

from __future__ import annotations

import json
import math
import os
import struct
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from . import dtypes
from .backends.piece_stream import WritebackKick
from .errors import DestinationNotEmptyError, MoeckptError
from .storage import Storage
from .storages import open_storage
from .writeback import Writeback, writeback_fd

__all__ = [
    "INDEX_FILE",
    "MAX_SHARD_BYTES",
    "HfExportError",
    "ShardTensor",
    "pack_shards",
    "parse_size",
    "shard_name",
    "write_shards",
]

INDEX_FILE = "model.safetensors.index.json"
#: the largest ``--max-shard-size`` taken (a petabyte: anything above is a typo).
MAX_SHARD_BYTES = 10**15
#: files a sharded export writes besides its shards (and ``overwrite`` replaces); anything else is left alone.
OWN_FILES = ("config.json", "generation_config.json", INDEX_FILE)


class HfExportError(MoeckptError, ValueError):
    """A checkpoint that cannot be written as Hugging Face safetensors (unknown architecture, bad shard size...)."""


@dataclass(frozen=True)
class ShardTensor:
    """One tensor of a sharded directory: its name there, its dtype (an index dtype name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def shard_name(k: int, n: int) -> str:
    """The file name of shard ``k`` (from 1) of ``n``, as ``transformers`` spells it."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def pack_shards(tensors: Iterable[ShardTensor], max_shard_size: int) -> list[list[ShardTensor]]:
    """Consecutive tensors packed into shards of at most ``max_shard_size`` bytes (a larger tensor gets its own).
    Within a shard the wider dtypes come first (stable otherwise), as safetensors' own writer orders them, so each
    tensor's data starts at a multiple of its item size."""
    if max_shard_size < 1:
        raise HfExportError(f"max shard size must be positive, got {max_shard_size}")
    shards: list[list[ShardTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [sorted(shard, key=lambda t: -dtypes.itemsize(t.dtype)) for shard in shards]


def shard_header(tensors: Sequence[ShardTensor]) -> bytes:
    """The safetensors header of a shard holding ``tensors`` in this order (padded to 8 bytes)."""
    doc: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        doc[t.name] = {
            "dtype": dtypes.to_safetensors(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


#: yields the bytes of one tensor, in order, in as many parts as the caller likes (the writer keeps none).
Produce = Callable[[ShardTensor], Iterable[bytes | bytearray | memoryview]]


@dataclass(frozen=True)
class ShardsWritten:
    """What :func:`write_shards` wrote."""

    files: tuple[str, ...]
    total_size: int
    num_tensors: int


def write_shards(
    out: str,
    shards: Sequence[Sequence[ShardTensor]],
    produce: Produce,
    *,
    overwrite: bool = False,
    extra_files: Callable[[], dict[str, bytes]] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> ShardsWritten:
    """Write ``shards`` (from :func:`pack_shards`) at ``out``: each shard's header, then each tensor's bytes as
    ``produce`` yields them, then ``extra_files()`` (``config.json``...), then the index (its weight map sorted by
    name, as ``save_pretrained`` writes it), last; committed as
    :class:`_Destination` says. A :class:`~moeckpt.formats.errors.MoeckptError` raised by ``produce`` (a damaged
    source) is raised as itself, not as a failure to write the output; either way nothing is left at ``out``.
    ``on_bytes`` is called with the size of every part written (progress bars)."""
    names = [shard_name(k + 1, len(shards)) for k in range(len(shards))]
    dest = _Destination(out, overwrite)
    try:
        weight_map = _write_all(dest.storage, names, shards, produce, on_bytes)
        for name, data in (extra_files() if extra_files is not None else {}).items():
            dest.storage.write_bytes(name, data)
        total = sum(t.nbytes for shard in shards for t in shard)
        # total_parameters is what transformers 5's save_pretrained adds beside total_size: elements, not bytes
        params = sum(math.prod(t.shape) for shard in shards for t in shard)
        dest.storage.write_bytes(
            INDEX_FILE,
            json_file(
                {
                    "metadata": {"total_parameters": params, "total_size": total},
                    "weight_map": dict(sorted(weight_map.items())),
                }
            ),
        )
        dest.commit()
    except _SourceFailed as e:
        dest.abort()
        raise e.error from None
    except BaseException:
        dest.abort()
        raise
    return ShardsWritten(files=tuple(names), total_size=total, num_tensors=len(weight_map))


def _write_all(storage: Storage, names, shards, produce: Produce, on_bytes) -> dict[str, str]:
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        with storage.open_write(name) as f:
            head = shard_header(shard)
            f.write(head)
            # On local disk the shard's writeback starts as it grows, as a checkpoint's does (formats/writeback.py):
            # the fsync that closes it then waits for the tail, not for the whole shard.
            with Writeback(writeback_fd(f) if storage.is_local else None) as writeback:
                kick = WritebackKick(f, len(head), writeback)
                for t in shard:
                    weight_map[t.name] = name
                    _write_tensor(f, t, produce, kick, on_bytes)
    return weight_map


def _write_tensor(f, t: ShardTensor, produce: Produce, kick: WritebackKick, on_bytes) -> None:
    written = 0
    try:
        for part in produce(t):
            n = memoryview(part).nbytes
            f.write(part)
            kick.wrote(n)
            written += n
            if on_bytes is not None:
                on_bytes(n)
            del part  # a producer's run is freed before it makes the next
    except MoeckptError as e:
        raise _SourceFailed(e) from None
    if written != t.nbytes:  # a producer bug would otherwise write a file safetensors misreads
        raise RuntimeError(f"{t.name}: {written} bytes produced for a {t.nbytes}-byte tensor")


def json_file(doc: dict) -> bytes:
    """A JSON document as the files of a Hugging Face directory hold it (indented, newline at the end)."""
    return (json.dumps(doc, indent=2) + "\n").encode()


def _is_own(name: str) -> bool:
    return name in OWN_FILES or (name.startswith("model") and name.endswith(".safetensors"))


class _SourceFailed(BaseException):
    """Carries a failure to read the source checkpoint out of an output file's ``open_write`` block, which would
    otherwise report it as a failure to write the output file."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


class _Destination:
    """Where a sharded directory is written, and its commit: nothing at OUT is one until it is complete.

    Local disk: everything goes into the sibling staging directory ``.<name>.partial`` (a rerun replaces what an
    interrupted write left there), which is renamed onto OUT at the end; files of OUT that are not the export's
    own (a tokenizer, a README) move over with ``overwrite``. Object stores: shards are written in place and
    ``config.json`` and the index last, so until the end OUT holds no loadable directory; a previous one's index
    goes first, and shards without an index (an interrupted write) are replaced without ``overwrite``.
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
        """Remove what a write that failed left (local staging; on object stores the shards written)."""
        try:
            if self.final.is_local:
                self.storage.remove()
            else:
                for name in self.storage.listdir():
                    if _is_own(name):
                        self.storage.remove(name)
        except (OSError, MoeckptError):
            pass  # the next write replaces what is left


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
