"""The safetensors backend: one standard ``.safetensors`` file per writing rank.

Each stored piece is one safetensors entry whose key names the logical tensor and the box offsets,
``"<tensor>@<o0>,<o1>,..."`` (its shape is the entry's shape). The header's ``__metadata__`` carries the
block checksums of every piece, so a reader verifies exactly the bytes it reads. Any safetensors reader can
open the files; reads here go by byte range (header first, then the bytes of the pieces needed). The writers
are in :mod:`.safetensors_write`.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import dtypes
from ..box import Box
from ..errors import DataFileError, StorageError
from ..index import SLICED_FORMAT_VERSION, FileEntry, Index, TensorEntry
from ..pieces import Piece, PieceRef, block_span, tensor_bytes, verify_blocks
from ..slices import column_span, verify_columns
from ..storage import Storage, StorageReader
from .base import BackendBase
from .block_checks import check_block_sums, verify_parts
from .piece_stream import BlockHasher
from .safetensors_header import (
    MAX_HEADER_BYTES,
    META_BLOCK_KEY,
    META_VERSION_KEY,
    NAME,
    file_name,
    header_bytes,
    parse_piece_key,
    piece_key,
)
from .safetensors_read import list_pieces, read_header
from .safetensors_write import encode, write_file, write_file_parallel, write_file_stream

if TYPE_CHECKING:
    import torch

#: a sliced piece's columns of at least this many rows are copied from a mapping of the file (one strided copy)
#: rather than read by a call per row, where the storage maps its files.
MAPPED_COLUMN_ROWS = 4
#: a verified read reads and hashes this many bytes at a time (within the CPU's cache: :meth:`_read_verified`).
HASH_STEP_BYTES = 512 * 1024

__all__ = [
    "MAX_HEADER_BYTES",
    "META_BLOCK_KEY",
    "META_VERSION_KEY",
    "NAME",
    "BlockHasher",
    "SafetensorsBackend",
    "SafetensorsReader",
    "encode",
    "file_name",
    "header_bytes",
    "list_pieces",
    "parse_piece_key",
    "piece_key",
    "read_header",
    "read_piece",
    "write_file",
    "write_file_parallel",
    "write_file_stream",
]


def read_piece(storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a piece, or only rows ``[r0, r1)`` of its dim 0 (in piece coordinates), verifying what is read.

    The read is widened to whole checksum blocks, so every byte returned was checked.
    """
    import torch

    where = storage.path(ref.file)
    shape = list(ref.box.shape)
    item = dtypes.itemsize(ref.dtype)
    if rows is None or not shape:
        r0, r1 = 0, shape[0] if shape else 1
    else:
        r0, r1 = rows
    row_bytes = (ref.nbytes // shape[0]) if shape and shape[0] else ref.nbytes
    lo, hi = r0 * row_bytes, r1 * row_bytes
    if not shape:
        lo, hi = 0, ref.nbytes
    unit = ref.unit_bytes
    b0 = lo // unit
    b1 = -(-hi // unit) if hi > 0 else 1
    read_lo, read_hi = b0 * unit, min(b1 * unit, ref.nbytes)
    buf = storage.read_range(ref.file, ref.start + read_lo, ref.start + read_hi)
    if len(buf) != read_hi - read_lo:
        raise DataFileError(f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated")
    verify_blocks(buf, b0, ref, where)
    out_shape = ([r1 - r0] + shape[1:]) if shape else []
    if hi == lo:
        return torch.empty(out_shape, dtype=dtypes.to_torch(ref.dtype))
    flat = torch.frombuffer(buf, dtype=torch.uint8, offset=lo - read_lo, count=hi - lo)
    del item
    return flat.view(dtypes.to_torch(ref.dtype)).reshape(out_shape)


# -- streaming writes: the header is sized before the data exists -----------------------------------------------


class SafetensorsBackend(BackendBase):
    """One ``rank-NNNNN.safetensors`` file per writer, its header listing every piece it holds."""

    name = NAME
    piecewise_writes = False  # one file per writer, its header listing every piece
    streams_slabs = True  # write_file_stream hashes and writes each slab as it comes
    fork_safe = True  # no threads of its own: forked offline writers run it, each on a core of its own
    stores_placements = True  # a writer's file holds exactly its placements

    def prepare(self, storage: Storage, tensors: dict[str, TensorEntry], boxes: dict[str, list[Box]]) -> None:
        del storage, tensors, boxes  # nothing shared to set up: every writer owns its file

    def write(
        self,
        storage: Storage,
        writer: int,
        pieces: Sequence[Piece],
        tensors: dict[str, TensorEntry],
        *,
        threads: int = 1,
    ) -> list[FileEntry]:
        if threads > 1:
            return [write_file_parallel(storage, file_name(writer), pieces, tensors, threads)]
        return [write_file(storage, file_name(writer), pieces, tensors)]

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
        del batch_bytes  # one file, streamed slab by slab
        chunks = ((pos, tensor_bytes(slab)) for pos, slab in slabs)
        return [write_file_stream(storage, file_name(writer), layout, tensors, chunks)]

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
        files: Iterable[FileEntry] = index.files.values()
        if writers is not None:
            wanted = {file_name(w) for w in writers}
            files = [f for f in files if f.path in wanted]
        refs = list_pieces(storage, files, index.tensors, slices=index.format_version >= SLICED_FORMAT_VERSION)
        if tensors is not None:
            keep = set(tensors)
            refs = [r for r in refs if r.tensor in keep]
        return refs

    def read_piece(self, storage: Storage, ref: PieceRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_piece(storage, ref, rows)

    def open_reader(self, storage: Storage) -> SafetensorsReader:
        return SafetensorsReader(storage)

    def top_level_names(self, writers: int, tensors: Collection[str]) -> set[str] | None:
        """One file per writer, named by :func:`file_name`."""
        return {file_name(w) for w in range(writers)}

    def writer_of(self, path: str) -> int | None:
        """``rank-NNNNN.safetensors`` is writer ``NNNNN``'s file (exactly :func:`file_name`'s spelling)."""
        stem = path.removeprefix("rank-").removesuffix(".safetensors")
        if stem.isdigit() and stem.isascii() and file_name(int(stem)) == path:
            return int(stem)
        return None


class SafetensorsReader:
    """Row reads of safetensors pieces straight into uninitialised tensors (``preadv`` on local disk), or mapped.

    The same bytes and checks as :func:`read_piece` (whole checksum blocks, each verified), minus the zero-filled
    ``bytearray`` it reads into, whose memset showed in every load's profile. Storages that only read
    byte ranges (fsspec URLs) take :func:`read_piece` itself, which builds the tensor on the range it fetched.
    """

    def __init__(self, storage: Storage):
        self.storage = storage
        self.location = storage.location
        self.fork_safe = storage.fork_safe
        self._files: StorageReader = storage.open_reader()
        self._scratch = threading.local()

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        import torch

        if not self._files.direct or not ref.box.ndim or not ref.nbytes:
            return read_piece(self.storage, ref, (lo, hi) if ref.box.ndim else None)
        a, b, b0, read_lo, read_hi = block_span(ref, lo, hi)
        buf = torch.empty(read_hi - read_lo, dtype=torch.uint8)
        where = self._read_whole(ref, read_lo, [buf.numpy().data] if len(buf) else [])
        verify_blocks(buf.numpy().data, b0, ref, where)
        return buf[a - read_lo : b - read_lo].view(dtypes.to_torch(ref.dtype)).reshape((hi - lo,) + ref.box.shape[1:])

    def read_rows_into(self, ref: PieceRef, lo: int, hi: int, out: torch.Tensor) -> bool:
        """Rows ``[lo, hi)`` of ``ref`` read straight into ``out`` (a contiguous CPU tensor of exactly those rows'
        bytes), verified like :meth:`read_rows`: the bytes of the checksum blocks around the rows that ``out``
        does not hold are read into small scratch buffers and hashed with it. No copy is made. False (nothing
        read) where this session cannot: a storage without direct reads, a 0-d or empty piece, another ``out``."""
        if not ref.box.ndim or hi <= lo:
            return False
        row = ref.nbytes // ref.box.shape[0]
        return self.read_bytes_into(ref, lo * row, hi * row, out)

    def read_blocks_into(self, ref: PieceRef, lo: int, hi: int, out: torch.Tensor) -> bool:
        """Rows ``[lo, hi)`` of ``ref``, whole checksum blocks (they start and end on block edges), read into
        ``out`` (contiguous, CPU, exactly their bytes) **unverified**: for a caller that verifies the blocks
        itself, where they land (a device load hashes them on the GPU: :mod:`moeckpt.reshard.device_checks`).
        False (nothing read) where the rows are not whole blocks or this session cannot read into memory."""
        import torch

        if not self._files.direct or not ref.box.ndim or hi <= lo or not ref.block_bytes or ref.geometry is not None:
            return False
        a, b, _, read_lo, read_hi = block_span(ref, lo, hi)
        if (a, b) != (read_lo, read_hi) or out.device.type != "cpu" or not out.is_contiguous():
            return False
        if out.numel() * out.element_size() != b - a:
            return False
        self._read_whole(ref, a, [out.reshape(-1).view(torch.uint8).numpy().data])
        return True

    def read_bytes_into(self, ref: PieceRef, a: int, b: int, out: torch.Tensor) -> bool:
        """Bytes ``[a, b)`` of ``ref``'s data straight into ``out`` (contiguous, CPU, ``b - a`` bytes), verified
        as :meth:`read_rows_into`: a contiguous part of a row (one TP rank's slice of an expert's matrix)."""
        import torch

        if out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() != b - a:
            return False
        return self.read_segments_into(ref, [(a, out.reshape(-1).view(torch.uint8).numpy().data)])

    def read_segments_into(self, ref: PieceRef, segments: Sequence[tuple[int, memoryview]]) -> bool:
        """Each ``(offset, buffer)`` of ``segments`` (sorted, not overlapping) filled with ``len(buffer)`` bytes of
        ``ref``'s data from ``offset``, in one vectored read of the checksum blocks around them, every block
        verified: the bytes between and around the segments land in scratch and are hashed with them. What a box
        made of several stored pieces (a TP-split matrix loaded whole) is read with, each source row straight
        into its place in the destination row. False (nothing read) where this session cannot: a storage
        without direct reads, a 0-d or empty piece, segments out of the piece."""
        if not self._files.direct or not ref.box.ndim or not segments or not ref.block_bytes:
            return False
        a, b = segments[0][0], segments[-1][0] + len(segments[-1][1])
        if a < 0 or b > ref.nbytes or b <= a:
            return False
        block = ref.unit_bytes
        b0 = a // block
        read_lo, read_hi = b0 * block, min(-(-b // block) * block, ref.nbytes)
        gaps = [off - end for (off, _), end in zip(segments, [read_lo] + [o + len(m) for o, m in segments[:-1]])]
        if min(gaps) < 0:
            return False
        scratch = self._scratch_bytes(sum(gaps) + read_hi - b)
        parts: list[memoryview] = []
        at = 0
        for gap, (_, buf) in zip(gaps, segments):
            if gap:
                parts.append(scratch[at : at + gap])
                at += gap
            parts.append(buf.cast("B") if buf.format != "B" else buf)
        if read_hi > b:
            parts.append(scratch[at:])
        self._read_verified(ref, read_lo, parts, b0)
        return True

    def read_columns_into(self, ref: PieceRef, s0: int, s1: int, c0: int, c1: int, out: torch.Tensor) -> bool:
        """Bytes ``[c0, c1)`` of each outer row ``s0 <= s < s1`` of a sliced piece (format version 5: rows are
        the dimensions before its slice dimension) into ``out``, a CPU uint8 tensor of shape ``(s1 - s0, c1 - c0)``
        whose rows are contiguous (a strided view of the destination is fine): a TP rank's columns of every row,
        read row by row, and only the slices that hold them, each slice's checksums verified over the rows read
        (widened to whole row groups and slices). False (nothing read) where this session cannot: a storage
        without direct reads, a piece without slices, another ``out``."""
        import torch

        g = ref.geometry
        if (
            g is None
            or not self._files.direct
            or out.device.type != "cpu"
            or out.dtype != torch.uint8
            or tuple(out.shape) != (s1 - s0, c1 - c0)
            or (s1 > s0 and out.stride(1) != 1)
            or not 0 <= s0 < s1 <= g.rows
            or not 0 <= c0 < c1 <= g.row_bytes
        ):
            return False
        first_group, first_slice, r0, r1, a, b = column_span(g, s0, s1, c0, c1)
        exact = (r0, r1, a, b) == (s0, s1, c0, c1)
        rows = out.numpy() if exact else np.empty((r1 - r0, b - a), dtype=np.uint8)
        where = self.storage.path(ref.file)
        base = ref.start + r0 * g.row_bytes + a
        try:
            if r1 - r0 < MAPPED_COLUMN_ROWS or not self._copy_columns_mapped(ref.file, base, g.row_bytes, rows):
                for i in range(r1 - r0):
                    view = rows[i].data
                    if self._files.read_into(ref.file, base + i * g.row_bytes, view) != len(view):
                        raise EOFError  # the mapping's short file too: one message below
        except EOFError:
            raise DataFileError(
                f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated"
            ) from None
        except FileNotFoundError:
            raise DataFileError(
                f"{where}: data file is missing (listed in the index); the checkpoint is incomplete"
            ) from None
        except StorageError as e:
            raise StorageError(f"{where}: reading tensor {ref.tensor!r} failed: {e}") from e
        verify_columns(
            rows, first_group, first_slice, g, ref.checksums, where, f"{ref.tensor!r} box {ref.box.to_json()}"
        )
        if not exact:
            out.numpy()[:] = rows[s0 - r0 : s1 - r0, c0 - a : c1 - a]
        return True

    def _copy_columns_mapped(self, file: str, base: int, stride: int, rows: np.ndarray) -> bool:
        """``rows[i]`` filled from ``len(rows[i])`` bytes of ``file`` at ``base + i * stride``, copied from a mapping
        of the file in one strided copy; False where the storage maps nothing. A read call per row costs more than
        its bytes where rows are narrow (a TP rank's half of a matrix row is a few KiB): the calls, not the bytes,
        were what such a load spent its time on. Only the pages holding the rows' bytes are touched."""
        n, width = rows.shape
        span = (n - 1) * stride + width
        found = self._files.map(file, base, span)
        if found is None:
            return False
        mapped, at = found
        src = np.lib.stride_tricks.as_strided(
            np.frombuffer(mapped, dtype=np.uint8, count=span, offset=at),
            shape=(n, width),
            strides=(stride, 1),
            writeable=False,
        )
        np.copyto(rows, src)
        return True

    def read_pieces_into(self, refs: Sequence[PieceRef], outs: Sequence[memoryview]) -> bool:
        """Whole pieces ``refs`` of one file, in file order and not overlapping, each read into its ``outs`` buffer
        (exactly its bytes) in one vectored read from the first's start to the last's end (the bytes between
        pieces land in scratch), each piece then verified block by block: what many small pieces stored back to
        back (norms, biases, routers) are loaded with, straight into their tensors or a staging buffer. False
        (nothing read) where this session cannot: a storage without direct reads, pieces in other files, out of
        order, empty or without checksum blocks, buffers of other sizes."""
        if not self._files.direct or not refs or len(refs) != len(outs):
            return False
        file, end = refs[0].file, refs[0].start
        gaps = []
        for ref, out in zip(refs, outs):
            if ref.file != file or ref.start < end or not ref.nbytes or not ref.block_bytes or len(out) != ref.nbytes:
                return False
            gaps.append(ref.start - end)
            end = ref.start + ref.nbytes
        scratch = self._scratch_bytes(max(gaps))
        parts: list[memoryview] = []
        for gap, out in zip(gaps, outs):
            if gap:
                parts.append(scratch[:gap])  # read and dropped: a gap is at most a few KiB, never verified twice
            parts.append(out.cast("B") if out.format != "B" else out)
        where = self._read_whole(refs[0], 0, parts)
        for ref, out in zip(refs, outs):
            verify_blocks(out, 0, ref, where)
        return True

    def _read_verified(self, ref: PieceRef, offset: int, parts: list[memoryview], first_block: int) -> None:
        """:meth:`_read_whole` and :func:`~.block_checks.verify_parts` interleaved: the bytes are read :data:`HASH_STEP_BYTES` at
        a time and each step is hashed at once, while it is still in the CPU's cache. Hashing a part after reading
        all of it read every byte from memory a second time, which is what a load on many cores is bound by
        (docs/benchmarks/README.md). A sliced piece's row groups are hashed across slices: read whole, then checked."""
        if ref.geometry is not None or not parts:
            where = self._read_whole(ref, offset, parts)
            verify_parts(parts, first_block, ref, where)
            return
        hasher = BlockHasher(ref.block_bytes)
        where = ""
        for part in parts:
            mv = part.cast("B") if part.format != "B" else part
            for at in range(0, len(mv), HASH_STEP_BYTES):
                step = mv[at : at + HASH_STEP_BYTES]
                where = self._read_whole(ref, offset, [step])
                hasher.update(step)
                offset += len(step)
        check_block_sums(hasher, parts, first_block, ref, where)

    def _scratch_bytes(self, nbytes: int) -> memoryview:
        """This thread's reused buffer for bytes that are read only to be hashed (the parts of checksum blocks a
        read does not need): a fresh one per read would be a page fault per page of it, every read."""
        buf = getattr(self._scratch, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._scratch.buf = memoryview(bytearray(nbytes))
        return buf[:nbytes]

    def _read_whole(self, ref: PieceRef, offset: int, parts: list[memoryview]) -> str:
        """Fill ``parts`` from byte ``offset`` of ``ref``'s data, all of them or a typed error naming the file and
        tensor; returns the file's path (for the checksum errors that may follow)."""
        where = self.storage.path(ref.file)
        try:
            got = self._files.read_into_parts(ref.file, ref.start + offset, parts) if parts else 0
        except FileNotFoundError:
            raise DataFileError(
                f"{where}: data file is missing (listed in the index); the checkpoint is incomplete"
            ) from None
        except StorageError as e:
            raise StorageError(f"{where}: reading tensor {ref.tensor!r} failed: {e}") from e
        if got != sum(len(p) for p in parts):
            raise DataFileError(f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated")
        return where

    def map_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor | None:
        """Checked like :meth:`read_rows` (whole checksum blocks), but nothing is copied into this process: the
        checksums are computed over the mapped pages, and the caller copies what it needs straight from them."""
        import torch

        found = self.map_rows_bytes(ref, lo, hi)
        if found is None:
            return None
        mapped, offset, nbytes = found
        shape = (hi - lo,) + ref.box.shape[1:]
        dtype = dtypes.to_torch(ref.dtype)
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        # Not a uint8 view: safetensors data need not sit at an offset aligned for its dtype (the header's length
        # is arbitrary), and torch refuses unaligned dtype views but reads an unaligned buffer fine.
        count = nbytes // dtypes.itemsize(ref.dtype)
        return torch.frombuffer(mapped, dtype=dtype, offset=offset, count=count).reshape(shape)

    def map_rows_bytes(
        self, ref: PieceRef, lo: int, hi: int, *, shared: bool = False
    ) -> tuple[mmap.mmap, int, int] | None:
        """:meth:`map_rows` as bytes: the mapping, where rows ``[lo, hi)`` begin in it and how many bytes they are,
        their checksum blocks verified over the mapped pages; None where the storage maps nothing or the piece has
        no rows. What a reader without torch (an export that moves bytes) takes; ``shared``: a shared read-only
        mapping (the page cache's pages, which a device load registers for DMA: :mod:`moeckpt.reshard.page_lock`)."""
        if not ref.box.ndim or not ref.nbytes:
            return None
        a, b, b0, read_lo, read_hi = block_span(ref, lo, hi)
        where = self.storage.path(ref.file)
        try:
            found = self._files.map(ref.file, ref.start + read_lo, read_hi - read_lo, shared=shared)
        except EOFError:
            raise DataFileError(
                f"{where}: file ends early reading tensor {ref.tensor!r}: the file is truncated"
            ) from None
        except FileNotFoundError:
            raise DataFileError(
                f"{where}: data file is missing (listed in the index); the checkpoint is incomplete"
            ) from None
        except StorageError as e:
            raise StorageError(f"{where}: reading tensor {ref.tensor!r} failed: {e}") from e
        if found is None:
            return None
        mapped, at = found
        verify_blocks(memoryview(mapped)[at:], b0, ref, where)
        return mapped, at + a - read_lo, b - a

    def advise(self, ref: PieceRef, lo: int, hi: int) -> None:
        if ref.box.ndim and ref.nbytes:
            row = ref.nbytes // ref.box.shape[0]
            self._files.advise(ref.file, ref.start + lo * row, (hi - lo) * row)

    def close(self) -> None:
        self._files.close()
        self._scratch = threading.local()  # every thread's scratch buffer goes with the old one
