"""A third checkpoint format, defined only in the tests to prove the backend seam: ``raw``.

Deliberately simple: every stored piece is one file of raw little-endian bytes, and every writer has a JSON
header ``raw-NNNNN.json`` listing its pieces (tensor, box, file, checksum). The index lists the headers (size and
checksum), so it grows with writers, not pieces. A read fetches a piece's whole file and checks its one checksum.
It knows nothing of the resharder: it implements the five required methods of the backend protocol on top of
:class:`~moeckpt.formats.backends.base.BackendBase` and is registered with ``register_backend``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import register_backend
from moeckpt.formats.backends.base import BackendBase
from moeckpt.formats.box import Box
from moeckpt.formats.checksum import checksum
from moeckpt.formats.errors import DataFileError
from moeckpt.formats.index import FileEntry, Index, TensorEntry, check_relative_path
from moeckpt.formats.pieces import Piece, PieceRef, block_checksums, tensor_bytes, verify_blocks
from moeckpt.formats.storage import Storage

NAME = "raw"


def header_name(writer: int) -> str:
    return f"raw-{writer:05d}.json"


class RawBackend(BackendBase):
    """One file per piece, one JSON header per writer."""

    name = NAME
    stores_placements = True  # a writer's header lists exactly its placements

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        del storage, tensors, boxes

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]:
        del threads  # one object per piece, written one after another
        listed = []
        for i, p in enumerate(q for q in pieces if not q.box.is_empty()):
            if dtypes.from_torch(p.data.dtype) != tensors[p.tensor].dtype:
                raise ValueError(
                    f"piece of {p.tensor!r} has dtype {p.data.dtype}, the index says {tensors[p.tensor].dtype}"
                )
            data = tensor_bytes(p.data)
            path = f"raw-{writer:05d}/{i:06d}.bin"
            storage.write_parts(path, [data])
            (digest,) = block_checksums(data, block_bytes=max(1, len(data)))
            listed.append({"tensor": p.tensor, "box": p.box.to_json(), "file": path, "checksum": digest})
        head = json.dumps({"format": "moeckpt-raw", "pieces": listed}).encode()
        storage.write_bytes(header_name(writer), head)
        return [FileEntry(path=header_name(writer), size=len(head), checksum=checksum(head))]

    def finish(self, storage: Storage, files: list[FileEntry], tensors: dict[str, TensorEntry]) -> list[FileEntry]:
        del storage, tensors
        return files

    def list_pieces(
        self,
        storage: Storage,
        index: Index,
        tensors: Collection[str] | None = None,
        writers: Collection[int] | None = None,
    ) -> list[PieceRef]:
        wanted = None if writers is None else {header_name(w) for w in writers}
        refs = []
        for entry in index.files.values():
            if wanted is not None and entry.path not in wanted:
                continue
            for ref in self._header(storage, entry, index.tensors):
                if tensors is None or ref.tensor in tensors:
                    refs.append(ref)
        return refs

    def _header(self, storage: Storage, entry: FileEntry, tensors: dict[str, TensorEntry]) -> list[PieceRef]:
        where = storage.path(entry.path)
        try:
            head = storage.read_bytes(entry.path)
        except FileNotFoundError:
            raise DataFileError(
                f"{where}: header is missing (listed in the index); the checkpoint is incomplete"
            ) from None
        if len(head) != entry.size or checksum(head) != entry.checksum:
            raise DataFileError(f"{where}: header differs from the index (size or checksum): it is corrupt")
        try:
            doc = json.loads(head)
            refs = []
            for p in doc["pieces"]:
                t = tensors[p["tensor"]]
                box = Box.from_json(p["box"])
                if not box.within(t.shape):
                    raise ValueError(f"box {p['box']} outside {list(t.shape)}")
                path = check_relative_path(p["file"], where)
                nbytes = box.numel * dtypes.itemsize(t.dtype)
                refs.append(PieceRef(t.name, box, t.dtype, path, 0, nbytes, (p["checksum"],), max(1, nbytes)))
            return refs
        except (KeyError, TypeError, ValueError) as e:
            raise DataFileError(f"{where}: not a raw header ({e})") from None

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        where = storage.path(ref.file)
        try:
            data = bytearray(storage.read_bytes(ref.file))
        except FileNotFoundError:
            raise DataFileError(f"{where}: piece file is missing; the checkpoint is incomplete") from None
        if len(data) != ref.nbytes:
            raise DataFileError(f"{where}: {len(data)} bytes, the header says {ref.nbytes}: the file is truncated")
        verify_blocks(data, 0, ref, where)
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        full = flat.view(dtypes.to_torch(ref.dtype)).reshape(ref.box.shape)
        return full[rows[0] : rows[1]] if rows is not None and ref.box.ndim else full

    def stored_objects(self, storage: Storage, index: Index) -> dict[str, int]:
        """The headers and every piece file they list."""
        out = {f.path: f.size for f in index.files.values()}
        out.update((r.file, r.nbytes) for r in self.list_pieces(storage, index))
        return out


register_backend(NAME, RawBackend)
