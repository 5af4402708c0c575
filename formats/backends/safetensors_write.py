"""Writing safetensors files: whole pieces (coalesced, or by several threads), or slabs streamed in order.

A save is bound by memory traffic and the disk, not by hashing, so the writers touch the data as few times as
possible (see :func:`write_file`; the byte streaming is :mod:`.piece_stream`'s); :func:`write_file_stream` holds
one slab at a time whatever the file size. The file layout is :mod:`.safetensors_header`'s; the bytes equal the
reference encoding :func:`encode`, which ``tests/golden`` pins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence

from .. import dtypes
from ..box import Box
from ..checksum import checksum
from ..errors import MoeckptError, StorageError
from ..index import FileEntry, TensorEntry
from ..pieces import Piece, block_checksums, tensor_bytes
from ..slices import SliceGeometry, SliceHasher, slice_checksums
from ..storage import Storage
from ..writeback import Writeback, writeback_fd
from .piece_stream import BlockHasher, Coalescer, WritebackKick, flat_if_scalar, stream_piece
from .safetensors_header import (
    CHECKSUM_PLACEHOLDER,
    block_count,
    dump_header,
    final_header,
    header_bytes,
    header_doc,
    piece_block,
    slicing,
)


def encode(pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> tuple[bytes, list[memoryview]]:
    """The header bytes (length prefix included) and the data buffers of a file holding ``pieces``.

    The reference encoding: :func:`write_file` streams the same bytes without materialising the buffers.
    """
    plan = _plan(pieces, tensors)
    buffers = [tensor_bytes(flat_if_scalar(p.data)) for p in plan]
    geoms = [slicing(p.box, tensors[p.tensor]) for p in plan]
    sums = [
        block_checksums(b, piece_block(p.box, tensors[p.tensor])) if g is None else slice_checksums(b, g)
        for p, b, g in zip(plan, buffers, geoms)
    ]
    return header_bytes([(p.tensor, p.box, s) for p, s in zip(plan, sums)], tensors), buffers


def write_file(storage: Storage, relpath: str, pieces: Sequence[Piece], tensors: dict[str, TensorEntry]) -> FileEntry:
    """Write (and on local disk fsync) one data file; returns its index entry. The bytes equal :func:`encode`'s.

    A save is bound by memory traffic and the disk, not by hashing, so the data is touched as few times as possible:
    each checksum block is hashed right before it is written, while it is still in the CPU cache; a piece that is a
    strided view of a trainer's local tensor (one block of a fused gate/up) is written row by row, never copied
    whole; small pieces are coalesced into large writes; and on local disk the writeback to the device starts while
    the rest is still being written (:class:`WritebackKick`). On local disk the header, whose length does not
    depend on the checksum values, is written last over a placeholder of the same length; other storages cannot
    seek back, so they hash in a first pass and then stream.
    """
    plan = _plan(pieces, tensors)
    # The header document is built once; only its checksums change between the placeholder and the final one.
    doc = header_doc(
        [(p.tensor, p.box, [CHECKSUM_PLACEHOLDER] * block_count(p.box, tensors[p.tensor])) for p in plan], tensors
    )
    keys = [k for k in doc if k != "__metadata__"]

    def header(sums: Sequence[Sequence[str]]) -> bytes:
        return final_header(doc, keys, sums)

    with storage.open_write(relpath) as f:
        if storage.is_local:
            placeholder = dump_header(doc)
            f.write(placeholder)
            with Writeback(writeback_fd(f)) as writeback:
                sink = Coalescer(f.write, WritebackKick(f, len(placeholder), writeback))
                sums = [stream_piece(p.data, sink.write, *_hashing(p.box, tensors[p.tensor])) for p in plan]
                sink.flush()
            head = final_header(doc, keys, sums, placeholder, storage.path(relpath))
            f.seek(0)
            f.write(head)
            f.seek(0, 2)
        else:
            sums = [stream_piece(p.data, None, *_hashing(p.box, tensors[p.tensor])) for p in plan]
            head = header(sums)
            f.write(head)
            sink = Coalescer(f.write)
            for p in plan:
                stream_piece(p.data, sink.write, *_hashing(p.box, tensors[p.tensor]))
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
    doc = header_doc(
        [(p.tensor, p.box, [CHECKSUM_PLACEHOLDER] * block_count(p.box, tensors[p.tensor])) for p in plan], tensors
    )
    keys = [k for k in doc if k != "__metadata__"]
    placeholder = dump_header(doc)
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

            sums = stream_piece(plan[i].data, write, *_hashing(plan[i].box, tensors[plan[i].tensor]))
            if at[0] - start >= WritebackKick.EVERY // 8:  # small pieces are left to the closing fsync
                writeback.start(start, at[0] - start)
            return sums

        with Writeback(fd) as writeback, ThreadPoolExecutor(threads, thread_name_prefix="moeckpt-write") as pool:
            sums = list(pool.map(lambda i: one(i, writeback), range(len(plan))))
        head = final_header(doc, keys, sums, placeholder, storage.path(relpath))
        f.seek(0)
        f.write(head)
        f.seek(0, 2)
    data_bytes = doc[keys[-1]]["data_offsets"][1] if keys else 0
    return FileEntry(path=relpath, size=len(head) + data_bytes, checksum=checksum(head))


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
    head_len = len(
        header_bytes([(t, b, [CHECKSUM_PLACEHOLDER] * block_count(b, tensors[t])) for t, b in kept], tensors)
    )
    hashers = [_hasher(b, tensors[t]) for t, b in layout]
    sizes = [b.numel * dtypes.itemsize(tensors[t].dtype) for t, b in layout]
    written = [0] * len(layout)

    failed: list[MoeckptError] = []

    def feed(sink, writeback: bool) -> None:
        try:
            with Writeback(writeback_fd(sink) if writeback else None) as started:
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


def _hasher(box: Box, entry: TensorEntry) -> BlockHasher | SliceHasher:
    """The hasher of a streamed piece: blocks, or slices (version 5) where its tensor's TP split cuts it."""
    geom = slicing(box, entry)
    return BlockHasher(piece_block(box, entry)) if geom is None else SliceHasher(geom)


def _hashing(box: Box, entry: TensorEntry) -> tuple[SliceGeometry | None, int]:
    """How a piece is hashed: its slices (version 5) or None, and its block size."""
    return slicing(box, entry), piece_block(box, entry)


class _SourceFailed(Exception):
    """Leaves :meth:`Storage.open_write` by an error when the data source of a streamed file failed."""


#: a streamed local file starts writeback every this many bytes.
_WRITEBACK_BYTES = 64 * 1024 * 1024
