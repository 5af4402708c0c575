"""Writing safetensors files: the header layout and the writers (whole pieces, or slabs streamed in order).

A save is bound by memory traffic and the disk, not by hashing, so the writers touch the data as few times as
possible (see :func:`write_file`); :func:`write_file_stream` holds one slab at a time whatever the file size.
The bytes equal the reference encoding :func:`encode`, which ``tests/golden`` pins.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from .. import dtypes
from ..box import Box
from ..checksum import checksum
from ..errors import DataFileError, MoeckptError, StorageError
from ..index import FileEntry, TensorEntry
from ..pieces import CHECKSUM_BLOCK_BYTES, Piece, block_checksums, tensor_bytes
from ..storage import Storage
from ..writeback import Writeback

NAME = "safetensors"
#: header size limit, as in the safetensors reference implementation (100 MB): refuses hostile lengths early.
MAX_HEADER_BYTES = 100_000_000
META_VERSION_KEY = "moeckpt.format_version"
META_BLOCK_KEY = "moeckpt.checksum_block_bytes"


def piece_key(tensor: str, box: Box) -> str:
    return f"{tensor}@{','.join(str(o) for o in box.offsets)}"


def parse_piece_key(key: str) -> tuple[str, tuple[int, ...]]:
    tensor, sep, offs = key.rpartition("@")
    if not sep or not tensor:
        raise ValueError(f"key {key!r} is not '<tensor>@<offsets>'")
    offsets = tuple(int(o) for o in offs.split(",")) if offs else ()
    return tensor, offsets


def file_name(writer: int) -> str:
    return f"rank-{writer:05d}.safetensors"


def encode(pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> tuple[bytes, list[memoryview]]:
    """The header bytes (length prefix included) and the data buffers of a file holding ``pieces``.

    The reference encoding: :func:`write_file` streams the same bytes without materialising the buffers.
    """
    plan = _plan(pieces, tensors)
    buffers = [tensor_bytes(_flat_if_scalar(p.data)) for p in plan]
    sums = [block_checksums(b) for b in buffers]
    return header_bytes([(p.tensor, p.box, s) for p, s in zip(plan, sums)], tensors), buffers


def write_file(storage: Storage, relpath: str, pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> FileEntry:
    """Write (and on local disk fsync) one data file; returns its index entry. The bytes equal :func:`encode`'s.

    A save is bound by memory traffic and the disk, not by hashing, so the data is touched as few times as possible:
    each checksum block is hashed right before it is written, while it is still in the CPU cache; a piece that is a
    strided view of a trainer's local tensor (one block of a fused gate/up) is written row by row, never copied
    whole; small pieces are coalesced into large writes; and on local disk the writeback to the device starts while
    the rest is still being written (:class:`_WritebackKick`). On local disk the header, whose length does not
    depend on the checksum values, is written last over a placeholder of the same length; other storages cannot
    seek back, so they hash in a first pass and then stream.
    """
    plan = _plan(pieces, tensors)
    # The header document is built once; only its checksums change between the placeholder and the final one.
    doc = _header_doc(
        [(p.tensor, p.box, [_CHECKSUM_PLACEHOLDER] * _blocks(p.box, tensors[p.tensor])) for p in plan], tensors
    )
    keys = [k for k in doc if k != "__metadata__"]

    def header(sums: Sequence[Sequence[str]]) -> bytes:
        return _final_header(doc, keys, sums)

    with storage.open_write(relpath) as f:
        if storage.is_local:
            placeholder = _dump_header(doc)
            f.write(placeholder)
            with Writeback(_writeback_fd(f)) as writeback:
                sink = _Coalescer(f.write, _WritebackKick(f, len(placeholder), writeback))
                sums = [_stream_piece(p.data, sink.write) for p in plan]
                sink.flush()
            head = _final_header(doc, keys, sums, placeholder, storage.path(relpath))
            f.seek(0)
            f.write(head)
            f.seek(0, 2)
        else:
            sums = [_stream_piece(p.data, None) for p in plan]
            head = header(sums)
            f.write(head)
            sink = _Coalescer(f.write)
            for p in plan:
                _stream_piece(p.data, sink.write)
            sink.flush()
    data_bytes = doc[keys[-1]]["data_offsets"][1] if keys else 0
    return FileEntry(path=relpath, size=len(head) + data_bytes, checksum=checksum(head))


def write_file_parallel(
    storage: Storage, relpath: str, pieces: Sequence[Piece], tensors: dict[str, TensorEntry], threads: int
) -> FileEntry:
    """:func:`write_file`'s bytes, written by ``threads`` threads at once: each piece is hashed and written at its
    own offset (``os.pwrite``), its writeback started as soon as it is written, then the header over its
    placeholder. Local files only (elsewhere, or with one thread, it is :func:`write_file`): for a store in memory
    (``/dev/shm``), where one thread copying and hashing the whole state, a page fault per new page, is the limit
    rather than a disk, and for a machine with cores to spare per saving rank."""
    if threads <= 1 or not storage.is_local or len(pieces) < 2:
        return write_file(storage, relpath, pieces, tensors)
    from concurrent.futures import ThreadPoolExecutor

    plan = _plan(pieces, tensors)
    doc = _header_doc(
        [(p.tensor, p.box, [_CHECKSUM_PLACEHOLDER] * _blocks(p.box, tensors[p.tensor])) for p in plan], tensors
    )
    keys = [k for k in doc if k != "__metadata__"]
    placeholder = _dump_header(doc)
    with storage.open_write(relpath) as f:
        f.write(placeholder)
        f.flush()  # the pieces go around the file object's buffer
        fd = f.fileno()

        def one(i: int, writeback: Writeback) -> list[str]:
            start = len(placeholder) + doc[keys[i]]["data_offsets"][0]
            at = [start]

            def write(mv: memoryview) -> None:
                mv = memoryview(mv).cast("B")
                done = 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:], at[0] + done)
                at[0] += len(mv)

            sums = _stream_piece(plan[i].data, write)
            if at[0] - start >= _WritebackKick.EVERY // 8:  # small pieces are left to the closing fsync
                writeback.start(start, at[0] - start)
            return sums

        with Writeback(fd) as writeback, ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-write") as pool:
            sums = list(pool.map(lambda i: one(i, writeback), range(len(plan))))
        head = _final_header(doc, keys, sums, placeholder, storage.path(relpath))
        f.seek(0)
        f.write(head)
        f.seek(0, 2)
    data_bytes = doc[keys[-1]]["data_offsets"][1] if keys else 0
    return FileEntry(path=relpath, size=len(head) + data_bytes, checksum=checksum(head))


def _final_header(
    doc: dict, keys: Sequence[str], sums: Sequence[Sequence[str]], placeholder: bytes | None = None, where: str = ""
) -> bytes:
    """The header with the pieces' block checksums filled in; the same length as ``placeholder`` when given (the
    header is written over it)."""
    for key, piece_sums in zip(keys, sums):
        doc["__metadata__"][key] = ",".join(piece_sums)
    head = _dump_header(doc)
    if placeholder is not None and len(head) != len(placeholder):
        raise DataFileError(
            f"{where}: header length changed from {len(placeholder)} to {len(head)} bytes after hashing; the checksum "
            "algorithm must produce fixed-length digests"
        )
    return head


def _plan(pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> list[Piece]:
    """The pieces that are stored (non-empty), after checking each dtype against the index."""
    out = []
    for p in pieces:
        entry = tensors[p.tensor]
        if dtypes.from_torch(p.data.dtype) != entry.dtype:
            raise ValueError(f"piece of {p.tensor!r} has dtype {p.data.dtype}, the index says {entry.dtype}")
        if not p.box.is_empty():  # empty ZeRO parts are legal in a layout and never stored
            out.append(p)
    return out


#: rows of a strided piece at least this long are written straight from the trainer's tensor; shorter ones are
#: gathered into a reused buffer first, so that small rows do not turn into many small writes.
_DIRECT_ROW_BYTES = 64 * 1024


def _stream_piece(data: torch.Tensor, write: Callable[[memoryview], object] | None) -> list[str]:
    """Hash a piece's bytes block by block, passing each part to ``write`` right after hashing it."""
    if data.device.type != "cpu":
        data = data.cpu()
    if data.is_contiguous() and data.numel() * data.element_size() <= CHECKSUM_BLOCK_BYTES:
        # Most pieces (norms, biases, small projections) are one contiguous block: skip the machinery below.
        mv = _contiguous_bytes(data)
        if write is not None:
            write(mv)
        return [checksum(mv)]
    hasher = BlockHasher()
    for frag in _fragments(data):
        for i in range(0, len(frag), CHECKSUM_BLOCK_BYTES):
            part = frag[i : i + CHECKSUM_BLOCK_BYTES]
            hasher.update(part)
            if write is not None:
                write(part)
    return hasher.finish()


def _flat_if_scalar(t: torch.Tensor) -> torch.Tensor:
    # A 0-dim tensor cannot be viewed as bytes of another element size; as one element it can, with the same bytes.
    return t.reshape(1) if t.dim() == 0 else t


def _fragments(t: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of ``t`` in row-major order as contiguous buffers, without copying a strided tensor whole.

    A yielded buffer may be reused for the next one: consume it before advancing.
    """
    t = _flat_if_scalar(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return
    if t.is_contiguous():
        yield _contiguous_bytes(t)
    elif t.stride(-1) == 1:
        # Rows of a view along a leading dim: walk them as numpy byte arrays, several times cheaper per row than
        # torch indexing (a fused gate/up block has a few hundred rows per piece).
        yield from _byte_rows(t.view(torch.uint8).numpy())
    else:
        yield from _gathered(t)


def _byte_rows(a: np.ndarray) -> Iterator[memoryview]:
    if a.flags.c_contiguous:
        yield a.data.cast("B")
        return
    if a[0].nbytes >= _DIRECT_ROW_BYTES:
        for row in a:
            yield from _byte_rows(row)
        return
    per = max(1, CHECKSUM_BLOCK_BYTES // a[0].nbytes)
    scratch = np.empty((min(per, a.shape[0]),) + a.shape[1:], dtype=np.uint8)
    for r0 in range(0, a.shape[0], per):
        n = min(per, a.shape[0] - r0)
        np.copyto(scratch[:n], a[r0 : r0 + n])
        yield scratch[:n].data.cast("B")


def _gathered(t: torch.Tensor) -> Iterator[memoryview]:
    """Any other layout (e.g. a transposed view): copied a block's worth of rows at a time into one buffer."""
    row_bytes = max(1, t[0].numel() * t.element_size())
    per = max(1, CHECKSUM_BLOCK_BYTES // row_bytes)
    scratch = torch.empty((min(per, t.shape[0]),) + tuple(t.shape[1:]), dtype=t.dtype)
    for r0 in range(0, t.shape[0], per):
        n = min(per, t.shape[0] - r0)
        scratch[:n].copy_(t[r0 : r0 + n])
        yield _contiguous_bytes(scratch[:n])


def _contiguous_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (a leaner :func:`tensor_bytes` for the hot loop)."""
    t = _flat_if_scalar(t)
    if t.numel() == 0:
        return memoryview(b"")
    return t.detach().view(torch.uint8).numpy().data.cast("B")


class _Coalescer:
    """Gathers small writes into one buffer so that hundreds of norm-sized pieces cost a few system calls.

    Large parts bypass the buffer (after flushing it), so big tensors are written straight from their memory.
    """

    LIMIT = 1 << 20

    def __init__(self, write: Callable[[memoryview], object], kick: _WritebackKick | None = None):
        self._write = write
        self._kick = kick
        self._buf = bytearray(self.LIMIT)
        self._used = 0

    def write(self, part: memoryview) -> None:
        n = len(part)
        if n >= self.LIMIT // 16:
            self.flush()
            self._write(part)
            if self._kick is not None:
                self._kick.wrote(n)
            return
        if self._used + n > self.LIMIT:
            self.flush()
        self._buf[self._used : self._used + n] = part
        self._used += n

    def flush(self) -> None:
        if self._used:
            self._write(memoryview(self._buf)[: self._used])
            if self._kick is not None:
                self._kick.wrote(self._used)
            self._used = 0


class _WritebackKick:
    """Starts the disk writeback of what was written so far, every ``EVERY`` bytes, without waiting for it
    (:class:`~moeckpt.formats.writeback.Writeback`): the closing fsync then finds most of the file on disk."""

    EVERY = 32 << 20

    def __init__(self, f, start: int, writeback: Writeback):
        self._f = f
        self._done = start  # bytes already handed to the kernel for writeback (the header placeholder is not)
        self._pos = start
        self._writeback = writeback

    def wrote(self, n: int) -> None:
        self._pos += n
        if self._pos - self._done < self.EVERY:
            return
        self._f.flush()
        self._writeback.start(self._done, self._pos - self._done)
        self._done = self._pos


#: a placeholder of the exact width of a checksum, so a header can be sized before its pieces are hashed.
_CHECKSUM_PLACEHOLDER = checksum(b"")


def header_bytes(layout: Sequence[tuple[str, Box, Sequence[str]]], tensors: dict[str, TensorEntry]) -> bytes:
    """The header (length prefix included) of a file holding pieces ``(tensor, box, block checksums)`` in order.

    Byte-identical to what :func:`encode` writes for the same pieces; empty boxes are skipped as there.
    """
    return _dump_header(_header_doc(layout, tensors))


def _header_doc(layout: Sequence[tuple[str, Box, Sequence[str]]], tensors: dict[str, TensorEntry]) -> dict:
    """The header as a JSON document; ``write_file`` fills in the checksums of ``__metadata__`` afterwards."""
    header: dict[str, object] = {}
    meta = {META_VERSION_KEY: "1", META_BLOCK_KEY: str(CHECKSUM_BLOCK_BYTES)}
    offset = 0
    for tensor, box, sums in layout:
        if box.is_empty():
            continue
        entry = tensors[tensor]
        nbytes = box.numel * dtypes.itemsize(entry.dtype)
        key = piece_key(tensor, box)
        header[key] = {
            "dtype": dtypes.to_safetensors(entry.dtype),
            "shape": list(box.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        meta[key] = ",".join(sums)
        offset += nbytes
    return {"__metadata__": meta, **header}


def _dump_header(doc: dict) -> bytes:
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data start to 8 bytes, as the safetensors writer does
    return struct.pack("<Q", len(raw)) + raw


class BlockHasher:
    """Block checksums of a byte stream fed in arbitrary slices (a piece written slab by slab)."""

    def __init__(self, block_bytes: int = CHECKSUM_BLOCK_BYTES):
        import xxhash

        self._new = xxhash.xxh3_64
        self._block = block_bytes
        self._h = self._new()
        self._fill = 0
        self.sums: list[str] = []

    def update(self, data: memoryview | bytes) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            take = min(len(mv), self._block - self._fill)
            self._h.update(mv[:take])
            self._fill += take
            mv = mv[take:]
            if self._fill == self._block:
                self.sums.append(f"xxh3_64:{self._h.hexdigest()}")
                self._h, self._fill = self._new(), 0

    def finish(self) -> list[str]:
        """The checksums, the last (short) block included; an empty stream has one checksum of no bytes."""
        if self._fill or not self.sums:
            self.sums.append(f"xxh3_64:{self._h.hexdigest()}")
            self._h, self._fill = self._new(), 0
        return self.sums


def write_file_stream(
    storage: Storage,
    relpath: str,
    layout: Sequence[tuple[str, Box]],
    tensors: dict[str, TensorEntry],
    chunks: Iterable[tuple[int, memoryview]],
) -> FileEntry:
    """Write a file whose pieces arrive in slabs, holding only one slab in memory.

    ``layout`` lists the pieces ``(tensor, box)`` in file order; ``chunks`` yields ``(piece position, bytes)`` in
    file order, each piece's bytes complete across its slabs. The header is sized first (checksums have a fixed
    width), the data streamed behind it while hashed, and the header written last by seeking back where the
    storage's file is seekable (local disk; S3, whose upload is spooled to a local file anyway), elsewhere by
    spooling the data to a local temporary file first (a ``memory://`` or other fsspec file is a write-once stream).
    """
    kept = [(t, b) for t, b in layout if not b.is_empty()]
    head_len = len(header_bytes([(t, b, [_CHECKSUM_PLACEHOLDER] * _blocks(b, tensors[t])) for t, b in kept], tensors))
    hashers = [BlockHasher() for _ in layout]
    sizes = [b.numel * dtypes.itemsize(tensors[t].dtype) for t, b in layout]
    written = [0] * len(layout)

    failed: list[MoeckptError] = []

    def feed(sink, writeback: bool) -> None:
        try:
            with Writeback(_writeback_fd(sink) if writeback else None) as started:
                _feed(sink, started)
        except MoeckptError as e:
            # A failure of the data source (a corrupt input piece), not of the write: re-raised as itself below,
            # outside the storage's "writing failed" wrapper.
            failed.append(e)

    def _feed(sink, writeback: Writeback) -> None:
        pending = 0
        end = head_len  # where the data written so far ends in the file
        hinted = head_len  # where the data not yet handed to the writeback begins
        for pos, data in chunks:
            mv = memoryview(data).cast("B")
            written[pos] += len(mv)
            if written[pos] > sizes[pos]:
                raise ValueError(f"{relpath}: piece {layout[pos][0]!r} {layout[pos][1].to_json()} got too many bytes")
            hashers[pos].update(mv)
            sink.write(mv)
            pending += len(mv)
            end += len(mv)
            if writeback.active and pending >= _WRITEBACK_BYTES:
                # Start writing back what was written since the last hint, so the final fsync waits for the tail
                # only. Not the whole file each time: that walks every page written so far again.
                sink.flush()
                writeback.start(hinted, end - hinted)
                hinted = end
                pending = 0
        for pos, (t, b) in enumerate(layout):
            if written[pos] != sizes[pos]:
                raise ValueError(f"{relpath}: piece {t!r} {b.to_json()} got {written[pos]} of {sizes[pos]} bytes")

    def final_header() -> bytes:
        sums = [h.finish() for h in hashers]
        head = header_bytes([(t, b, s) for (t, b), s in zip(layout, sums)], tensors)
        if len(head) != head_len:
            raise ValueError(f"{relpath}: header size changed while streaming ({head_len} -> {len(head)})")
        return head

    if storage.seekable_writes:
        try:
            with storage.open_write(relpath) as f:
                f.seek(head_len)
                # Local disk: start writeback early. An S3 spool is read back by the upload right away: keep it cached.
                feed(f, writeback=storage.is_local)
                if failed:
                    raise _SourceFailed  # leave the context by an error: S3 then uploads nothing
                head = final_header()
                f.seek(0)
                f.write(head)
        except StorageError:
            if not failed:
                raise
            # open_write wrapped _SourceFailed; the source's own error is raised below
    else:
        with tempfile.TemporaryFile() as spool:
            feed(spool, writeback=False)  # the spool is read back right away: keep it cached
            if not failed:
                head = final_header()
                spool.seek(0)
                with storage.open_write(relpath) as f:
                    f.write(head)
                    shutil.copyfileobj(spool, f, 16 * 1024 * 1024)
    if failed:
        raise failed[0]
    return FileEntry(path=relpath, size=head_len + sum(sizes), checksum=checksum(head))


class _SourceFailed(Exception):
    """Leaves :meth:`Storage.open_write` by an error when the data source of a streamed file failed."""


#: a streamed local file starts writeback every this many bytes.
_WRITEBACK_BYTES = 64 * 1024 * 1024


def _writeback_fd(sink) -> int | None:
    """The descriptor of a local file to start writeback on, or None."""
    if not hasattr(sink, "fileno"):
        return None
    try:
        return sink.fileno()
    except (OSError, ValueError):
        return None


def _blocks(box: Box, entry: TensorEntry) -> int:
    return max(1, -(-box.numel * dtypes.itemsize(entry.dtype) // CHECKSUM_BLOCK_BYTES))
