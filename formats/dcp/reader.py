"""Read access to a torch DCP checkpoint directory (local or fsspec URL): its tensors, chunks and values.

:class:`DcpCheckpoint` parses ``.metadata`` with the restricted unpickler, checks that every data file it names
exists and is long enough, and locates each chunk's bytes inside its ``.distcp`` record
(:func:`~moeckpt.formats.dcp.payload.locate_tensor`, in parallel). After that, reading rows of a chunk is one byte
range (``os.pread`` on local files, a range request on object stores): no ``torch.load``, no whole-file reads.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self, cast

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import StorageError
from moeckpt.formats.storage import Storage, storage_error
from moeckpt.formats.storages import open_storage
from moeckpt.formats.storages.local import LocalFiles

from . import payload
from .bounds import Read
from .metadata import (
    MAX_METADATA_BYTES,
    METADATA_NAME,
    DcpFormatError,
    DcpMetadata,
    DcpTensor,
    Record,
    read_metadata,
)

#: bytes of ``.metadata`` asked for at a time from an object store (from local disk: what the scan asks for).
_REMOTE_READ = 8 * 1024 * 1024


@dataclass(frozen=True)
class StoredChunk:
    """A chunk of a DCP tensor with the absolute byte range of its elements (C order) in ``file``."""

    tensor: str
    box: Box
    dtype: str
    file: str
    start: int
    nbytes: int


class DcpCheckpoint:
    """A DCP checkpoint directory, read without running any of its pickles."""

    def __init__(self, location: str, *, workers: int = 8) -> None:
        self.storage = open_storage(location)
        self.location = self.storage.location
        self.workers = max(1, workers)
        self.metadata: DcpMetadata = _load_metadata(self.storage)
        self._sizes = self._check_files()
        # The storage's read session: on local disk the open files every read, mapping and hint goes through.
        self._files = self.storage.open_reader()
        self._chunks: dict[str, tuple[StoredChunk, ...]] = {}

    # -- what it holds -------------------------------------------------------------------------------------
    @property
    def tensors(self) -> dict[str, DcpTensor]:
        return self.metadata.tensors

    @property
    def values(self) -> dict[str, Record]:
        return self.metadata.values

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def _check_files(self) -> dict[str, int]:
        records = [c.record for t in self.tensors.values() for c in t.chunks] + list(self.values.values())
        sizes: dict[str, int] = {}
        for f in sorted({r.file for r in records}):
            try:
                sizes[f] = self.storage.size(f)
            except FileNotFoundError:
                raise DcpFormatError(f"{self.storage.path(f)}: data file named by .metadata is missing") from None
        for r in records:
            if r.offset + r.length > sizes[r.file]:
                raise DcpFormatError(
                    f"{self.storage.path(r.file)}: an item at bytes {r.offset}..{r.offset + r.length} runs past the "
                    f"end of the {sizes[r.file]}-byte file; the file is truncated"
                )
        return sizes

    # -- chunks ---------------------------------------------------------------------------------------------
    def chunks(self, names: list[str] | None = None) -> dict[str, tuple[StoredChunk, ...]]:
        """The located chunks of ``names`` (default: every tensor), each chunk's zip record read once."""
        wanted = list(self.tensors) if names is None else names
        todo = [(n, c) for n in wanted if n not in self._chunks for c in self.tensors[n].chunks]
        if todo:
            # Each chunk's record is located by small reads at both of its ends, a thousand scattered reads for a
            # large checkpoint: hinted all at once, the disk serves them in parallel instead of a few at a time.
            for _, c in todo:
                for lo, hi in payload.probe_ranges(c.record.length):
                    self.advise(c.record.file, c.record.offset + lo, hi - lo)
            with ThreadPoolExecutor(self.workers) as pool:
                found = list(pool.map(lambda nc: self._locate(*nc), todo))
            by_name: dict[str, list[StoredChunk]] = {}
            for sc in found:
                by_name.setdefault(sc.tensor, []).append(sc)
            for n in {n for n, _ in todo}:
                self._chunks[n] = tuple(by_name.get(n, ()))
        return {n: self._chunks[n] for n in wanted}

    def _locate(self, name: str, chunk) -> StoredChunk:
        tensor = self.tensors[name]
        rec = chunk.record
        where = f"{self.storage.path(rec.file)} (tensor {name!r} chunk at {list(chunk.box.offsets)})"
        cache: dict[tuple[int, int], bytes] = {}

        def read(lo: int, hi: int) -> bytes:
            lo, hi = max(0, lo), min(rec.length, hi)
            for (a, b), data in cache.items():  # the probes at both ends hold most small reads
                if a <= lo and hi <= b:
                    return data[lo - a : hi - a]
            data = self.read_bytes(rec.file, rec.offset + lo, rec.offset + hi)
            if len(data) != hi - lo:
                raise DcpFormatError(f"{where}: the file ends early; it is truncated")
            if hi - lo >= 1024:
                cache[(lo, hi)] = data
            return data

        if rec.length > payload.PROBE_BYTES and chunk.box.numel:
            read(0, payload.PROBE_BYTES)
        loc = payload.locate_tensor(read, rec.length, chunk.box.shape, tensor.dtype, where)
        return StoredChunk(name, chunk.box, tensor.dtype, rec.file, rec.offset + loc.start, loc.nbytes)

    # -- bytes -------------------------------------------------------------------------------------------
    def _fd(self, relpath: str) -> int:
        """The open file of a local data file (called on local storage only)."""
        return cast(LocalFiles, self._files).fd(relpath)

    def read_bytes(self, relpath: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a data file."""
        if not self.storage.is_local:
            return bytes(self.storage.read_range(relpath, start, end))
        try:
            return os.pread(self._fd(relpath), end - start, start)
        except OSError as e:
            raise StorageError(f"{self.storage.path(relpath)}: reading bytes {start}..{end} failed: {e}") from e

    def read_into(self, relpath: str, start: int, out: torch.Tensor) -> None:
        """Fill the (contiguous, CPU) tensor ``out`` with the bytes at ``start`` of a data file."""
        n = out.numel() * out.element_size()
        if n == 0:
            return
        view = memoryview(cast(Any, out.view(-1).view(torch.uint8).numpy()))
        if self.storage.is_local:
            try:
                got = os.preadv(self._fd(relpath), [view], start)
            except OSError as e:
                raise StorageError(
                    f"{self.storage.path(relpath)}: reading bytes {start}..{start + n} failed: {e}"
                ) from e
        else:
            data = self.storage.read_range(relpath, start, start + n)
            got = len(data)
            view[:got] = data
        if got != n:
            raise DcpFormatError(
                f"{self.storage.path(relpath)}: the file ends early reading {n} bytes at {start}; it is truncated"
            )

    def advise(self, relpath: str, start: int, length: int) -> None:
        """Ask the kernel to read bytes ``[start, start + length)`` of a local data file ahead, into the page cache,
        while the caller works on earlier ones (a hint: nothing happens elsewhere, or where it is refused)."""
        try:
            self._files.advise(relpath, start, length)
        except OSError:  # a hint only: the read that follows reports a missing or unreadable file
            return

    def map_bytes(self, relpath: str, start: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A tensor over bytes at ``start`` of a local data file, mapped from the page cache (nothing copied).

        A private, copy-on-write mapping: nothing written through it reaches the file; it is unmapped when the
        last view goes. The file's size is checked first: touching a mapping past the end of a file that was
        truncated meanwhile would kill the process (SIGBUS) instead of raising.
        """
        torch_dtype = dtypes.to_torch(dtype)
        count = math.prod(shape)
        n = count * dtypes.itemsize(dtype)
        if n == 0:
            return torch.empty(shape, dtype=torch_dtype)
        fd = self._fd(relpath)
        where = self.storage.path(relpath)
        base = start - start % mmap.ALLOCATIONGRANULARITY
        try:
            if os.fstat(fd).st_size < start + n:
                raise DcpFormatError(f"{where}: the file ends before byte {start + n}; it was truncated")
            mapped = mmap.mmap(fd, start - base + n, offset=base, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise StorageError(f"{where}: mapping bytes {start}..{start + n} failed: {e}") from e
        return torch.frombuffer(mapped, dtype=torch_dtype, offset=start - base, count=count).reshape(shape)

    def read_chunk(self, chunk: StoredChunk, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A chunk's elements (or rows ``[r0, r1)`` of its dim 0) as a tensor of its dtype."""
        shape = chunk.box.shape
        start = chunk.start
        if rows is not None and shape:
            r0, r1 = rows
            row = chunk.nbytes // shape[0] if shape[0] else 0
            start += r0 * row
            shape = (r1 - r0,) + shape[1:]
        out = torch.empty(shape, dtype=dtypes.to_torch(chunk.dtype))
        self.read_into(chunk.file, start, out)
        return out

    def read_tensor(self, name: str) -> torch.Tensor:
        """A whole tensor assembled from its chunks (small tensors: checks, tests)."""
        t = self.tensors[name]
        out = torch.empty(t.shape, dtype=dtypes.to_torch(t.dtype))
        for c in self.chunks([name])[name]:
            out[c.box.slices()] = self.read_chunk(c)
        return out

    def read_value(self, name: str) -> object:
        """A non-tensor item decoded as JSON data (or :data:`~moeckpt.formats.dcp.payload.NOT_JSON`)."""
        rec = self.values[name]
        where = f"{self.storage.path(rec.file)} (value {name!r})"
        if rec.length > payload.MAX_VALUE_BYTES:
            raise DcpFormatError(f"{where}: {rec.length} bytes is larger than moeckpt decodes")
        return payload.decode_value(self.read_bytes(rec.file, rec.offset, rec.offset + rec.length), where)

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_metadata(storage: Storage) -> DcpMetadata:
    """``.metadata`` of ``storage``, read only once it is known to be a regular file of at most
    ``MAX_METADATA_BYTES`` (a link to ``/dev/zero``, a FIFO, a sparse file of gigabytes are refused before any
    read; on an object store, by the size its listing gives), and checked opcode by opcode as it is read."""
    where = storage.path(METADATA_NAME)
    try:
        if storage.is_local:
            fd, size = _open_local(storage, where)
            try:
                return read_metadata(_local_reader(fd, where), where, size)
            finally:
                os.close(fd)
        try:
            size = storage.size(METADATA_NAME)
        except FileNotFoundError:
            raise _missing(storage, where) from None
        _check_size(size, where)
        return read_metadata(_remote_reader(storage, size), where, size)
    except MemoryError:
        raise DcpFormatError(
            f"{where}: parsing it ran out of memory; it is not DCP metadata this machine can hold"
        ) from None


def _missing(storage: Storage, where: str) -> DcpFormatError:
    hint = ""
    if storage.exists("moeckpt.json"):
        hint = " (it is a moeckpt checkpoint: use it directly, or `moeckpt export-dcp` to make a DCP one)"
    return DcpFormatError(f"{where}: missing; {storage.location} is not a torch DCP checkpoint{hint}")


def _check_size(size: int, where: str) -> None:
    if size > MAX_METADATA_BYTES:
        raise DcpFormatError(
            f"{where}: {size} bytes is larger than any DCP metadata moeckpt reads (at most {MAX_METADATA_BYTES}, "
            "about twice what a 1,024-rank save of a large MoE writes); the file is damaged or not DCP metadata"
        )
    if size == 0:
        raise DcpFormatError(f"{where}: the file is empty; the save that wrote it did not finish")


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _open_local(storage: Storage, where: str) -> tuple[int, int]:
    """The open ``.metadata`` of a local checkpoint and its size, once ``fstat`` shows a regular file small enough.

    Opened without blocking (opening a FIFO would wait for a writer) and checked on the open file, so a path
    swapped between a check and the open cannot slip through; a link is followed to what it names.
    """
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _missing(storage, where) from None
    except IsADirectoryError:
        raise DcpFormatError(f"{where}: is a directory, not a regular file; not DCP metadata") from None
    except OSError as e:
        raise storage_error(e, "opening", where) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
            raise DcpFormatError(f"{where}: is {kind}, not a regular file; not DCP metadata")
        _check_size(st.st_size, where)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def _local_reader(fd: int, where: str) -> Read:
    """``read(n)`` of an open local ``.metadata`` that refuses to go past ``MAX_METADATA_BYTES`` (a file that grows
    while it is read)."""
    total = [0]

    def read(n: int) -> bytes:
        try:
            data = os.read(fd, min(n, MAX_METADATA_BYTES + 1 - total[0]))
        except OSError as e:
            raise storage_error(e, "reading", where) from None
        total[0] += len(data)
        if total[0] > MAX_METADATA_BYTES:
            _check_size(total[0], where)
        return data

    return read


def _remote_reader(storage: Storage, size: int) -> Read:
    """``read(n)`` of ``.metadata`` on an object store: byte ranges, up to the size its listing gave."""
    pos = [0]

    def read(n: int) -> bytes:
        if pos[0] >= size:
            return b""
        data = storage.read_range(METADATA_NAME, pos[0], min(size, pos[0] + max(n, _REMOTE_READ)))
        pos[0] += len(data)
        return bytes(data)

    return read


def open_dcp(location: str, *, workers: int = 8) -> DcpCheckpoint:
    """Open the DCP checkpoint at ``location`` (a local directory or an fsspec URL)."""
    return DcpCheckpoint(location, workers=workers)
