"""One tensor as a zarr v3 array: its document (shape, stored dtype, chunk grid, codecs; the real dtype in its
attributes), the objects of its grid cells, and the group documents its name implies.

:class:`ArrayPlan` writes the array document moeckpt stores and reads back only that layout, checked against the
index; its cells are the stored pieces a reader lists (:func:`cell_refs`). The grid itself is chosen from the
writers' pieces by :func:`~.zarr.plan_array`; a cell's bytes are :mod:`.zarr_cells`'s.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from itertools import product
from typing import Any

from .. import dtypes
from ..box import Box
from ..compression import BLOSC_ZSTD, NONE
from ..errors import CheckpointIndexError, DataFileError
from ..index import INDEX_NAME, TensorEntry
from ..pieces import PieceRef

META_NAME = "zarr.json"
#: a hostile or broken array document must not make a reader enumerate billions of cells.
MAX_CELLS_PER_ARRAY = 10_000_000

#: dtypes zarr lacks, stored as the unsigned integer of the same width.
_STORED_AS = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}
BYTES_CODEC = {"name": "bytes", "configuration": {"endian": "little"}}
CRC_CODEC = {"name": "crc32c"}
#: the blosc settings of ``--compress blosc-zstd`` (docs/zarr.md). On a trained checkpoint no other setting measured
#: (zstd level 3, bit shuffle, lz4) stored any role smaller, and level 3 encodes slower (docs/benchmarks/compress.md).
BLOSC_CNAME = "zstd"
BLOSC_CLEVEL = 1
BLOSC_BLOCKSIZE = 1 << 20
#: the array data-file version of a compressed array (an uncompressed one stays version 1, byte for byte).
COMPRESSED_DATA_VERSION = 2


def blosc_codec(itemsize: int) -> dict[str, Any]:
    """zarr v3's ``blosc`` codec as ``blosc-zstd`` writes it: byte shuffle at the element size."""
    return {
        "name": "blosc",
        "configuration": {
            "cname": BLOSC_CNAME,
            "clevel": BLOSC_CLEVEL,
            "shuffle": "shuffle",
            "typesize": itemsize,
            "blocksize": BLOSC_BLOCKSIZE,
        },
    }


def chunk_codecs(compress: str, itemsize: int) -> list[dict[str, Any]]:
    """The codecs of one (inner) chunk: raw bytes then crc32c; compressed, the crc32c of the decoded bytes (what a
    reader gets) is compressed with them and the compressed bytes get a crc32c of their own (checked first, so a
    damaged object is reported before it is decoded)."""
    if compress == NONE:
        return [BYTES_CODEC, CRC_CODEC]
    return [BYTES_CODEC, CRC_CODEC, blosc_codec(itemsize), CRC_CODEC]


def stored_dtype(dtype: str) -> str:
    """The zarr ``data_type`` a moeckpt dtype is stored as."""
    return _STORED_AS.get(dtype, dtype)


@dataclass(frozen=True)
class ArrayPlan:
    """How one tensor is stored: its grid cell (one object each) and the inner chunks of a cell."""

    tensor: str
    shape: tuple[int, ...]
    dtype: str
    #: the zarr chunk grid: one cell = one stored object = part of exactly one piece.
    shard: tuple[int, ...]
    #: inner chunk shape within a cell (sharding codec), or ``None`` when a cell is one plain chunk.
    inner: tuple[int, ...] | None
    #: the compression setting of every (inner) chunk (:mod:`~moeckpt.formats.compression`).
    compress: str = NONE

    @property
    def meta_path(self) -> str:
        return f"{self.tensor}/{META_NAME}"

    @property
    def cell_bytes(self) -> int:
        return math.prod(self.shard) * dtypes.itemsize(self.dtype)

    def key(self, cell: Box) -> str:
        """The object of a grid cell (zarr's default chunk key encoding, ``/`` separator)."""
        return "/".join([self.tensor, "c", *(str(o // s) for o, s in zip(cell.offsets, self.shard))])

    def cells(self, within: Box | None = None) -> Iterator[Box]:
        """The grid cells of ``within`` (the whole tensor by default), which must be a union of cells."""
        box = within if within is not None else Box.full(self.shape)
        ranges = []
        for d, s in enumerate(self.shard):
            lo, hi = box.offsets[d], box.end[d]
            if lo % s or (hi % s and hi != self.shape[d]):
                raise CheckpointIndexError(
                    f"tensor {self.tensor!r}: piece {box.to_json()} is not aligned to the zarr chunk grid "
                    f"{list(self.shard)}; prepare() was given other pieces than the writers write"
                )
            ranges.append(range(lo, hi, s))
        for offs in product(*ranges):
            yield Box(tuple(offs), tuple(min(s, n - o) for o, s, n in zip(offs, self.shard, self.shape)))

    def stored_shape(self, cell: Box) -> tuple[int, ...] | None:
        """The padded shape an edge cell is stored with, or ``None`` when the cell is a whole chunk."""
        return None if cell.shape == self.shard else self.shard

    def n_cells(self) -> int:
        return math.prod(-(-n // s) for n, s in zip(self.shape, self.shard))

    def metadata(self) -> dict[str, Any]:
        kind = dtypes.to_torch(self.dtype)
        fill: Any = (
            False if self.dtype == "bool" else (0.0 if kind.is_floating_point and self.dtype not in _STORED_AS else 0)
        )
        if kind.is_complex:
            fill = [0.0, 0.0]  # zarr v3 writes a complex fill value as [real, imaginary]
        chunk = chunk_codecs(self.compress, dtypes.itemsize(self.dtype))
        if self.inner is None:
            codecs: list[dict[str, Any]] = chunk
        else:
            codecs = [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": list(self.inner),
                        "codecs": chunk,
                        "index_codecs": [BYTES_CODEC, CRC_CODEC],
                        "index_location": "start",
                    },
                }
            ]
        return {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": stored_dtype(self.dtype),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": codecs,
            "attributes": {
                "moeckpt": {
                    "dtype": self.dtype,
                    "format_version": 1 if self.compress == NONE else COMPRESSED_DATA_VERSION,
                }
            },
        }

    def metadata_bytes(self) -> bytes:
        return json.dumps(self.metadata(), indent=2).encode()

    @classmethod
    def from_metadata(cls, raw: bytes, entry: TensorEntry, where: str) -> ArrayPlan:
        """Parse an array document written by :meth:`metadata_bytes` and check it against the index entry."""
        try:
            doc = json.loads(raw.decode("utf-8"))
            shard = tuple(int(s) for s in doc["chunk_grid"]["configuration"]["chunk_shape"])
            codecs = doc["codecs"]
            inner = None
            if codecs and codecs[0].get("name") == "sharding_indexed":
                inner = tuple(int(s) for s in codecs[0]["configuration"]["chunk_shape"])
                codecs = codecs[0]["configuration"]["codecs"]
            # the layout check below compares the whole document with the one this setting writes
            compress = BLOSC_ZSTD if any(c.get("name") == "blosc" for c in codecs) else NONE
            shape = tuple(doc["shape"])
            dtype = doc["attributes"]["moeckpt"]["dtype"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, IndexError):
            raise DataFileError(f"{where}: not a zarr array document written by moeckpt") from None
        if shape != entry.shape or dtype != entry.dtype:
            raise DataFileError(
                f"{where}: array has shape {list(shape)} and dtype {dtype}, the index says {list(entry.shape)} "
                f"{entry.dtype} for tensor {entry.name!r}"
            )
        if (
            len(shard) != len(shape)
            or any(s < 1 for s in shard)
            or any(s > max(n, 1) for s, n in zip(shard, shape))
            or (inner is not None and (len(inner) != len(shard) or any(i < 1 or s % i for i, s in zip(inner, shard))))
        ):
            raise DataFileError(
                f"{where}: chunk grid {list(shard)} / inner chunks {inner} do not fit shape {list(shape)}"
            )
        plan = cls(entry.name, entry.shape, entry.dtype, shard, inner, compress)
        if plan.metadata_bytes() != bytes(raw):
            raise DataFileError(
                f"{where}: array document is not in the layout moeckpt writes (codecs or encoding differ)"
            )
        if plan.n_cells() > MAX_CELLS_PER_ARRAY:
            raise DataFileError(f"{where}: chunk grid {list(shard)} makes more than {MAX_CELLS_PER_ARRAY} objects")
        return plan


def group_metadata_bytes(path: str) -> bytes:
    """The document of group ``path`` (the root one names the index)."""
    attrs = {"moeckpt": {"index": INDEX_NAME, "format_version": 1}} if path == "" else {}
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}, indent=2).encode()


def meta_path_of(group_or_array: str) -> str:
    """Where the document of a group or an array is stored."""
    return f"{group_or_array}/{META_NAME}" if group_or_array else META_NAME


def chunk_array(path: str, tensors: Collection[str]) -> str | None:
    """The tensor whose chunk (or shard) object ``path`` is (``<tensor>/c/<i>/...``, or ``<tensor>/c`` for a 0-d
    array), else ``None``."""
    i = path.find("/c")
    while i != -1:
        rest = path[i + 2 :]
        if (rest == "" or rest.startswith("/")) and path[:i] in tensors:
            return path[:i]
        i = path.find("/c", i + 1)
    return None


def array_of(path: str) -> str | None:
    """The tensor whose array document ``path`` is, or ``None`` for the root document."""
    if path == META_NAME or not path.endswith("/" + META_NAME):
        return None
    return path[: -len(META_NAME) - 1]


def cell_refs(plan: ArrayPlan) -> list[PieceRef]:
    """One stored piece per grid cell of ``plan``, its object and the rows a reader fetches and verifies at once."""
    item = dtypes.itemsize(plan.dtype)
    row_bytes = math.prod(plan.shard[1:]) * item
    band_rows = plan.inner[0] if plan.inner is not None else (plan.shard[0] if plan.shard else 1)
    out = []
    for cell in plan.cells():
        nbytes = cell.numel * item
        block = max(1, band_rows * row_bytes) if plan.shape else max(1, nbytes)
        out.append(
            PieceRef(
                plan.tensor,
                cell,
                plan.dtype,
                plan.key(cell),
                0,
                nbytes,
                (),
                block,
                plan.inner,
                plan.stored_shape(cell),
                plan.compress,
            )
        )
    return out
