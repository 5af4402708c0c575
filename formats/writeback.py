"""Starting the disk writeback of what a save wrote so far, without waiting for it and without evicting it.

The kernel keeps a file's pages dirty until the closing fsync and only then writes them, so the disk idles while a
save hashes and copies, and the CPU idles while the disk works. Starting the writeback of each range once it is
written overlaps the two; the fsync then finds most of the file on disk already.

Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` does exactly that. ``posix_fadvise(POSIX_FADV_DONTNEED)`` (what
saves used before) also starts the writeback, but drops the pages already written back from the page cache: when
the disk keeps up, half a just-saved checkpoint was no longer cached, and a load right after it (a resume, an
export, a benchmark's load) read it from disk again. It remains the fallback where ``sync_file_range`` cannot be
called. Elsewhere there is no hint, and a save merely overlaps less.

Either call can block while the disk's queue is full (37 ms a call was measured on a virtual disk during an
import, half a second of four writers' time), so a save hands its ranges to a thread of the file's own
(:class:`Writeback`) and goes on copying and hashing meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
from collections.abc import Callable

__all__ = ["Writeback", "start_writeback", "writeback_fd"]

#: ``SYNC_FILE_RANGE_WRITE`` (linux/fs.h): start writing the dirty pages of the range, do not wait.
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range``, from the symbols the process has loaded already (``find_library`` would run
    ``ldconfig`` at every start-up), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Start writing bytes ``[offset, offset + length)`` of ``fd`` back to the disk; the pages stay cached.

    Returns False where no hint works for this file (the caller stops asking); the save is then merely slower."""
    if length <= 0:
        return True
    if _SYNC is not None and _SYNC(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            return True
        except OSError:
            return False
    return False


def writeback_fd(sink: object) -> int | None:
    """The descriptor of a file object to start writeback on, or None where it has none (a spool, a stream)."""
    fileno = getattr(sink, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
    except (OSError, ValueError):
        return None
    return fd if isinstance(fd, int) else None


class Writeback:
    """The writeback of one open file, started range by range by a thread of its own (see the module).

    ``start`` hands a range over and returns at once; ``close`` (or leaving the ``with`` block) waits for the
    ranges handed over so far, and must come before the file is closed. ``fd=None``: nothing is done."""

    def __init__(self, fd: int | None):
        self._fd = fd
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if fd is not None:
            self._thread = threading.Thread(target=self._run, name="moeckpt-writeback", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        """Whether ranges are being started (a file was given and the session is open)."""
        return self._thread is not None

    def start(self, offset: int, length: int) -> None:
        """Start writing bytes ``[offset, offset + length)`` back (in the background)."""
        if self._thread is not None:
            self._ranges.put((offset, length))

    def _run(self) -> None:
        working = True
        while (item := self._ranges.get()) is not None:
            if working and self._fd is not None:
                working = start_writeback(self._fd, *item)  # a file that takes no hint is not asked again

    def close(self) -> None:
        if self._thread is not None:
            self._ranges.put(None)
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
