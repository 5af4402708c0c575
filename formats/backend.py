"""The backend protocol every on-disk format implements, and the registry that picks one by name.

A backend turns pieces (boxes of logical tensors) into stored bytes and back. The built-in ones live in
:mod:`moeckpt.formats.backends` (``safetensors``, ``zarr``) and are imported only when first asked for; another
one is added with :func:`register_backend`, after which the index, the CLI's ``--format`` and the trainer accept
its name (they all ask :func:`backend_names`). ``moeckpt.testing.BackendTests`` is the contract a backend passes.

This module imports nothing of the format layer at run time, so the index can validate names against the
registry without an import cycle.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from .compression import NONE, check_compress
from .errors import CheckpointIndexError

if TYPE_CHECKING:
    import torch

    from .box import Box
    from .index import FileEntry, Index, TensorEntry
    from .pieces import Piece, PieceRef
    from .storage import Storage


class PieceReader(Protocol):
    """A read session over one checkpoint's stored pieces (``Backend.open_reader``): what a resharder's chunk
    cache calls, from several threads at once. Every byte returned was verified against its checksum."""

    #: where the pieces are (for error messages).
    location: str
    #: whether the session may be opened again in a forked child (no threads or event loops it depends on).
    fork_safe: bool

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the stored piece ``ref`` (its dim 0; a 0-d piece is read whole), verified."""
        ...

    def map_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor | None:
        """The same rows without a copy into this process (mapped from the page cache, then verified), or
        ``None`` where the backend or storage cannot map. Offline resharding only: a trainer's state must not be
        backed by a file."""
        ...

    def advise(self, ref: PieceRef, lo: int, hi: int) -> None:
        """Ask the storage to read rows ``[lo, hi)`` ahead (a hint; a no-op where there is none)."""
        ...

    def close(self) -> None:
        """Release what the session holds (after the reads in flight ended)."""
        ...


class Backend(Protocol):
    """How pieces become stored bytes and back. Built in: safetensors (one file per writer) and zarr."""

    name: str
    #: True when :meth:`write` may be called several times for one writer, each with some of its pieces (the
    #: backend stores each piece on its own); False when a writer's pieces must come in one call (one file each).
    piecewise_writes: bool
    #: True when :meth:`write_stream` writes each slab before it draws the next, so the caller may hand every slab
    #: in one reused buffer; False when it keeps slabs until it has whole pieces.
    streams_slabs: bool
    #: True when the backend's readers and writers hold no threads of their own that a forked child would
    #: inherit dead, so a resharder may run writers in forked processes (where the storage allows it too).
    fork_safe: bool
    #: True when the stored pieces are exactly the writing layout's placements, each in its writer's own files:
    #: a reader then locates them from the index alone and reads only the files of the writers it needs
    #: (:meth:`list_pieces` honours ``writers``). False when pieces are stored otherwise (zarr: grid cells).
    stores_placements: bool
    #: How ``moeckpt inspect`` sums up the files of a backend whose index lists metadata documents, not the data
    #: (the data being objects the index does not list: zarr's chunks): a format string of ``files`` (how many the
    #: index lists), ``meta`` (their size), ``chunks`` (the objects it does not list) and ``data`` (their size).
    #: ``None`` when the index lists the data files themselves, which ``inspect`` names one by one.
    files_summary: str | None
    #: The compression settings (:mod:`~moeckpt.formats.compression`) the backend can write; optional: a backend
    #: without it stores bytes raw (``("none",)``). :func:`get_backend` sets ``compress`` to the one asked for.
    #: compressions: tuple[str, ...]

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        """Run once before any writer: ``boxes`` lists every non-empty piece of every tensor, over all writers."""
        ...

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]:
        """Store one writer's pieces (durably, on local disk) and return the index entries of what it wrote;
        ``threads``: how many threads may write them at once (a hint a backend may ignore)."""
        ...

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
        """Store one writer's pieces ``layout`` (``(tensor, box)`` in order) from row slabs arriving in order:
        ``(position in layout, contiguous rows)``, each piece's slabs complete, at least one per piece. Memory
        stays a slab (or, with ``piecewise_writes``, a batch of about ``batch_bytes``), never the writer's share."""
        ...

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        """Run once after every writer, before the commit; may add entries (e.g. zarr metadata)."""
        ...

    def list_pieces(
        self,
        storage: Storage,
        index: Index,
        tensors: Collection[str] | None = None,
        writers: Collection[int] | None = None,
    ) -> list[PieceRef]:
        """The stored pieces of ``tensors`` (all if ``None``), looking only at ``writers``' files if given."""
        ...

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The data of one piece, or rows ``[r0, r1)`` of its dim 0, checksums verified."""
        ...

    def open_reader(self, storage: Storage) -> PieceReader:
        """A read session for many row reads of pieces at ``storage`` (see :class:`PieceReader`)."""
        ...

    def stored_objects(self, storage: Storage, index: Index) -> dict[str, int]:
        """``{path: size}`` of every object the checkpoint occupies, its index ``moeckpt.json`` left out."""
        ...

    def top_level_names(self, writers: int, tensors: Collection[str]) -> set[str] | None:
        """The top-level entries (files, folders) a save of ``tensors`` by ``writers`` writers puts in the
        checkpoint, its index left out; ``None`` when the backend cannot say before it writes. A save with
        ``overwrite`` replaces exactly these and the index, never anything else a folder holds."""
        ...

    def writer_of(self, path: str) -> int | None:
        """The writer whose own file ``path`` (relative to the checkpoint) is, where each writer's pieces are
        files of its own (``stores_placements``); ``None`` for any other path, or a backend that stores otherwise.
        Whoever holds a copy of some of a checkpoint's files (the memory tier's nodes) knows from it whose pieces
        it can read."""
        ...


#: built-in backends by name -> "module:class", imported on first use.
_BUILTIN: dict[str, str] = {
    "safetensors": "moeckpt.formats.backends.safetensors:SafetensorsBackend",
    "zarr": "moeckpt.formats.backends.zarr:ZarrBackend",
}
_REGISTERED: dict[str, Callable[[], Backend]] = {}


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    """Add (or replace) the backend ``name``; ``factory()`` makes an instance (a class will do)."""
    if not isinstance(name, str) or not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a backend name is a non-empty word (letters, digits, '-', '_'), got {name!r}")
    _REGISTERED[name] = factory


def backend_names() -> tuple[str, ...]:
    """Every backend name the index, the CLI and the trainer accept: the built-ins, then the registered ones."""
    return tuple(dict.fromkeys([*_BUILTIN, *_REGISTERED]))


def get_backend(name: str, *, compress: str = NONE) -> Backend:
    """A new instance of the backend ``name``, writing with the compression setting ``compress``;
    :class:`CheckpointIndexError` naming the known ones otherwise, or when it cannot write that compression."""
    factory = _REGISTERED.get(name)
    if factory is None and name in _BUILTIN:
        module, _, cls = _BUILTIN[name].partition(":")
        try:
            factory = getattr(importlib.import_module(module), cls)
        except ImportError as e:
            raise CheckpointIndexError(f"the {name} backend is not available: {e}") from None
    if factory is None:
        raise CheckpointIndexError(f"unknown checkpoint format {name!r}; choose one of: {', '.join(backend_names())}")
    backend = factory()
    if compress != NONE:
        check_compress(compress)
        if compress not in compressions_of(backend):
            able = [n for n in backend_names() if n != name and compress in _compressions_or_none(n)]
            raise CheckpointIndexError(
                f"the {name} format stores bytes raw: it cannot write compression {compress!r}; write it with "
                f"compression none, or in a format that compresses ({', '.join(able) or 'none is available'})"
            )
        backend.compress = compress  # type: ignore[attr-defined]
    return backend


def compressions_of(backend: Backend) -> tuple[str, ...]:
    """The compression settings ``backend`` writes (``("none",)`` for one that does not say)."""
    return tuple(getattr(backend, "compressions", (NONE,)))


def backend_compressions(name: str) -> tuple[str, ...]:
    """The compression settings the backend ``name`` writes."""
    return compressions_of(get_backend(name))


def _compressions_or_none(name: str) -> tuple[str, ...]:
    try:
        return backend_compressions(name)
    except CheckpointIndexError:  # a backend that cannot be loaded here compresses nothing here
        return (NONE,)
