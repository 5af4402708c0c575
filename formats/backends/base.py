"""What most backends share: a read session over ``read_piece``, a streamed write over ``write``, the stored objects.

A backend may subclass :class:`BackendBase` and implement only ``prepare / write / finish / list_pieces /
read_piece``; the built-in safetensors backend overrides the rest with its faster paths.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

from ..pieces import Piece

if TYPE_CHECKING:
    import torch

    from ..backend import Backend, PieceReader
    from ..box import Box
    from ..index import FileEntry, Index, TensorEntry
    from ..pieces import PieceRef
    from ..storage import Storage


class PieceReaderBase:
    """A :class:`~moeckpt.formats.backend.PieceReader` that reads through ``backend.read_piece``: no mapping, no
    hints."""

    def __init__(self, backend: Backend, storage: Storage):
        self.backend = backend
        self.storage = storage
        self.location = storage.location
        self.fork_safe = bool(backend.fork_safe and storage.fork_safe)

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        return self.backend.read_piece(self.storage, ref, (lo, hi) if ref.box.ndim else None)

    def map_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor | None:
        return None

    def advise(self, ref: PieceRef, lo: int, hi: int) -> None:
        return None

    def close(self) -> None:
        return None


def write_stream_by_pieces(
    backend: Backend,
    storage: Storage,
    writer: int,
    layout: Sequence[tuple[str, Box]],
    tensors: dict[str, TensorEntry],
    slabs: Iterable[tuple[int, torch.Tensor]],
    *,
    batch_bytes: int,
) -> list[FileEntry]:
    """``write_stream`` for a backend that stores whole pieces: each piece's slabs are joined and handed to
    ``backend.write``, in batches of about ``batch_bytes`` when it stores pieces one by one (``piecewise_writes``),
    else all of the writer's pieces in one call."""
    import torch

    entries: list[FileEntry] = []
    batch: list[Piece] = []
    held = 0
    for pos, group in itertools.groupby(slabs, key=lambda item: item[0]):
        parts = [slab for _, slab in group]
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        del parts
        tensor, box = layout[pos]
        batch.append(Piece(tensor, box, data))
        held += data.numel() * data.element_size()
        if backend.piecewise_writes and held >= batch_bytes:
            entries += backend.write(storage, writer, batch, tensors)
            batch, held = [], 0
    if batch or not entries:
        entries += backend.write(storage, writer, batch, tensors)
    return entries


class BackendBase:
    """Defaults for the optional parts of the backend protocol (see :class:`~moeckpt.formats.backend.Backend`)."""

    name = ""
    piecewise_writes = False
    streams_slabs = False
    fork_safe = False
    stores_placements = False
    #: the index lists the data files (a backend whose index lists only metadata says how ``inspect`` sums it up).
    files_summary: str | None = None

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        raise NotImplementedError

    def top_level_names(self, writers: int, tensors: Collection[str]) -> set[str] | None:
        return None  # not known before the save writes: a save beside foreign entries is then refused on S3

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]:
        raise NotImplementedError

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        raise NotImplementedError

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        raise NotImplementedError

    def list_pieces(
        self,
        storage: Storage,
        index: Index,
        tensors: Collection[str] | None = None,
        writers: Collection[int] | None = None,
    ) -> list[PieceRef]:
        raise NotImplementedError

    def write_stream(
        self,
        storage: Storage,
        writer: int,
        layout: Sequence[tuple[str, Box]],
        tensors: dict[str, TensorEntry],
        slabs: Iterable[tuple[int, torch.Tensor]],
        *,
        batch_bytes: int,
    ) -> list[FileEntry]:
        return write_stream_by_pieces(self, storage, writer, layout, tensors, slabs, batch_bytes=batch_bytes)

    def open_reader(self, storage: Storage) -> PieceReader:
        return PieceReaderBase(self, storage)

    def stored_objects(self, storage: Storage, index: Index) -> dict[str, int]:
        """The data files the index lists (a backend whose index lists every object it writes)."""
        del storage
        return {f.path: f.size for f in index.files.values()}

    def writer_of(self, path: str) -> int | None:
        """No file is known to be one writer's own (a backend that stores placements overrides this)."""
        del path
        return None
