"""The backend protocol every on-disk format implements, and the registry that picks one by name."""

from __future__ import annotations

from typing import Collection, Protocol, Sequence

import torch

from .box import Box
from .errors import CheckpointIndexError
from .index import FileEntry, Index, TensorEntry
from .pieces import Piece, PieceRef
from .storage import Storage


class Backend(Protocol):
    """How pieces become stored bytes and back. Implementations: safetensors (one file per writer) and zarr."""

    name: str
    #: True when :meth:`write` may be called several times for one writer, each with some of its pieces (the
    #: backend stores each piece on its own); False when a writer's pieces must come in one call (one file each).
    piecewise_writes: bool

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        """Run once before any writer: ``boxes`` lists every non-empty piece of every tensor, over all writers."""

    def write(
        self, storage: Storage, writer: int, pieces: Sequence[Piece], tensors: dict[str, TensorEntry]
    ) -> list[FileEntry]:
        """Store one writer's pieces (durably, on local disk) and return the index entries of what it wrote."""

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        """Run once after every writer, before the commit; may add entries (e.g. zarr metadata)."""

    def list_pieces(
        self,
        storage: Storage,
        index: Index,
        tensors: Collection[str] | None = None,
        writers: Collection[int] | None = None,
    ) -> list[PieceRef]:
        """The stored pieces of ``tensors`` (all if ``None``), looking only at ``writers``' files if given."""

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The data of one piece, or rows ``[r0, r1)`` of its dim 0, checksums verified."""


class SafetensorsBackend:
    """One ``rank-NNNNN.safetensors`` file per writer; see :mod:`moeckpt.formats.safetensors_backend`."""

    name = "safetensors"
    piecewise_writes = False  # one file per writer, its header listing every piece

    def prepare(self, storage, tensors, boxes) -> None:
        del storage, tensors, boxes  # nothing shared to set up: every writer owns its file

    def write(self, storage, writer, pieces, tensors):
        from . import safetensors_backend as st

        return [st.write_file(storage, st.file_name(writer), pieces, tensors)]

    def finish(self, storage, files, tensors):
        del storage, tensors
        return files

    def list_pieces(self, storage, index, tensors=None, writers=None):
        from . import safetensors_backend as st

        files = index.files.values()
        if writers is not None:
            wanted = {st.file_name(w) for w in writers}
            files = [f for f in files if f.path in wanted]
        refs = st.list_pieces(storage, files, index.tensors)
        if tensors is not None:
            keep = set(tensors)
            refs = [r for r in refs if r.tensor in keep]
        return refs

    def read_piece(self, storage, ref, rows=None):
        from . import safetensors_backend as st

        return st.read_piece(storage, ref, rows)


_BACKENDS: dict[str, type] = {"safetensors": SafetensorsBackend}


def register_backend(name: str, cls: type) -> None:
    _BACKENDS[name] = cls


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS and name == "zarr":
        try:
            from . import zarr_backend  # noqa: F401  (registers itself)
        except ImportError as e:
            raise CheckpointIndexError(f"the zarr backend is not available: {e}") from None
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise CheckpointIndexError(
            f"unknown checkpoint format {name!r}; choose one of: {', '.join(sorted(set(_BACKENDS) | {'zarr'}))}"
        ) from None
