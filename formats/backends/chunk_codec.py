"""The byte-level work of a zarr chunk, off the interpreter lock: crc32c, blosc encode and decode, and the pool
of threads that runs them on the host's spare cores.

The Python bindings hold the interpreter lock for part of this work: ``google_crc32c.value`` releases it only for
``bytes`` of 1 MiB or more (never for the views a chunk is), and numcodecs' ``blosc.compress`` returns a slice
of its output, a copy made under the lock; decoding needs a fresh ``bytearray`` per chunk, zeroed under it. With
one thread per core that lock, not the cores, bounded a compressed save or load (docs/benchmarks/compress.md).
So where the shared libraries those bindings ship export the C functions (libcrc32c's ``crc32c_value``; the
``blosc_compress_ctx`` / ``blosc_decompress_ctx`` built into numcodecs' blosc extension), they are called through
:mod:`ctypes`, which releases the lock for the call, into buffers the caller owns. Where they are not found, or
a self-test at first use disagrees with the binding, the bindings are used as before: the same bytes, slower
(:data:`NATIVE` says which; ``MOECKPT_NATIVE_CODEC=0`` forces the bindings, which the tests use).

The bytes written are blosc's own, whichever path made them: both call the same compressor with the same
arguments (the ``ctx`` entry point with one internal thread, which is what numcodecs uses off the main thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import google_crc32c
import numpy as np
from numcodecs import blosc as _blosc_binding

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

#: bytes blosc may add to its input (its header), the most a frame can exceed what it encodes.
BLOSC_MAX_OVERHEAD = 16
#: the codec pool's size at most: beyond this many threads a chunk's work no longer speeds up on one host.
CODEC_THREADS_MAX = 32

Buffer = bytes | bytearray | memoryview | np.ndarray


def _address(buf: Buffer) -> tuple[np.ndarray, int]:
    """A byte array viewing ``buf`` (kept alive by the caller for the call) and its address."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    return arr, arr.ctypes.data


class _Native:
    """The C entry points, or ``None`` for each that was not found."""

    def __init__(self) -> None:
        self.crc: Callable[..., int] | None = None
        self.compress: Callable[..., int] | None = None
        self.decompress: Callable[..., int] | None = None
        if os.environ.get("MOECKPT_NATIVE_CODEC", "1") == "0":
            return
        self.crc = _load_crc()
        self.compress, self.decompress = _load_blosc()


def _load_crc() -> Callable[..., int] | None:
    from google_crc32c import _crc32c  # the binding's extension: dlsym finds the library it links, wherever it lies

    candidates = [_crc32c.__file__]
    system = ctypes.util.find_library("crc32c")
    if system:
        candidates.append(system)
    for path in candidates:
        try:
            fn = ctypes.CDLL(path).crc32c_value
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = ctypes.c_uint32
        probe = np.frombuffer(b"moeckpt crc32c self-test" * 3, dtype=np.uint8)
        if fn(probe.ctypes.data, probe.nbytes) == google_crc32c.value(probe.tobytes()):
            return fn
    log.info("crc32c: no GIL-free entry point found for google_crc32c; using its binding")
    return None


def _load_blosc() -> tuple[Callable[..., int] | None, Callable[..., int] | None]:
    try:
        lib = ctypes.CDLL(_blosc_binding.__file__)
        comp, decomp = lib.blosc_compress_ctx, lib.blosc_decompress_ctx
    except (OSError, AttributeError):
        log.info("blosc: numcodecs' extension exports no blosc_*_ctx; using its binding")
        return None, None
    comp.argtypes = [
        ctypes.c_int,  # clevel
        ctypes.c_int,  # doshuffle
        ctypes.c_size_t,  # typesize
        ctypes.c_size_t,  # nbytes
        ctypes.c_void_p,  # src
        ctypes.c_void_p,  # dest
        ctypes.c_size_t,  # destsize
        ctypes.c_char_p,  # compressor
        ctypes.c_size_t,  # blocksize
        ctypes.c_int,  # numinternalthreads
    ]
    comp.restype = ctypes.c_int
    decomp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    decomp.restype = ctypes.c_int
    probe = (np.arange(4096, dtype=np.float32) * 0.5).tobytes()
    want = _blosc_binding.compress(probe, b"zstd", 1, _blosc_binding.SHUFFLE, 1 << 20, 4)
    src = np.frombuffer(probe, dtype=np.uint8)
    out = np.empty(len(probe) + BLOSC_MAX_OVERHEAD, dtype=np.uint8)
    n = comp(
        1, _blosc_binding.SHUFFLE, 4, src.nbytes, src.ctypes.data, out.ctypes.data, out.nbytes, b"zstd", 1 << 20, 1
    )
    if n <= 0 or out[:n].tobytes() != want:
        log.info("blosc: the C entry point's self-test disagrees with numcodecs' binding; using the binding")
        return None, None
    return comp, decomp


_native: _Native | None = None
_native_lock = threading.Lock()


def native() -> _Native:
    """The C entry points found (once per process)."""
    global _native
    if _native is None:
        with _native_lock:
            if _native is None:
                _native = _Native()
    return _native


def uses_native() -> dict[str, bool]:
    """Which work runs off the interpreter lock here: ``{"crc32c": ..., "blosc": ...}``."""
    n = native()
    return {"crc32c": n.crc is not None, "blosc": n.compress is not None}


def crc32c_int(data: Buffer) -> int:
    """The crc32c of ``data`` (any buffer), off the interpreter lock where the C function was found."""
    fn = native().crc
    if fn is None:
        return int(google_crc32c.value(np.frombuffer(data, dtype=np.uint8) if not isinstance(data, bytes) else data))
    arr, addr = _address(data)
    return int(fn(addr, arr.nbytes))


def crc32c(data: Buffer) -> bytes:
    """The 4-byte little-endian crc32c the zarr ``crc32c`` codec appends."""
    return struct.pack("<I", crc32c_int(data))


def blosc_compress(src: Buffer, cname: str, clevel: int, shuffle: int, blocksize: int, typesize: int) -> memoryview:
    """One blosc frame of ``src`` (a view of a buffer of its own, exactly the frame's length)."""
    fn = native().compress
    if fn is None:
        return memoryview(_blosc_binding.compress(src, cname.encode(), clevel, shuffle, blocksize, typesize))
    arr, addr = _address(src)
    out = np.empty(arr.nbytes + BLOSC_MAX_OVERHEAD, dtype=np.uint8)
    n = fn(clevel, shuffle, typesize, arr.nbytes, addr, out.ctypes.data, out.nbytes, cname.encode(), blocksize, 1)
    if n <= 0:
        raise RuntimeError(f"blosc compression failed ({n})")
    return out[:n].data  # a memoryview of the frame's bytes


def blosc_decompress_into(frame: Buffer, out: np.ndarray) -> None:
    """Decode the blosc ``frame`` into ``out`` (a contiguous byte array of exactly the decoded size)."""
    fn = native().decompress
    if fn is None:
        _blosc_binding.decompress(frame, out)
        return
    arr, addr = _address(frame)
    n = fn(addr, out.ctypes.data, out.nbytes, 1)
    if n != out.nbytes:
        raise RuntimeError(f"blosc decompression failed ({n}, expected {out.nbytes} bytes)")


# -- the codec pool --------------------------------------------------------------------------------------------


def host_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def codec_threads() -> int:
    """The pool's size: this process's share of the cores it may run on (``LOCAL_WORLD_SIZE`` ranks on a host
    share them), at least 1."""
    try:
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        ranks = 1
    return max(1, min(CODEC_THREADS_MAX, host_cores() // ranks))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of its parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def codec_map(fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """``map(fn, items)`` over the codec pool, results in order; the first failure is raised.

    Its tasks never wait on the pool themselves, so any thread (a writer's, a reader's) may call this without a
    deadlock; one item, or a pool of one thread, runs in the caller.
    """
    work = list(items)
    if len(work) <= 1 or codec_threads() <= 1:
        return map(fn, work)
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(codec_threads(), thread_name_prefix="moeckpt-codec")
        pool = _pool
    futures = [pool.submit(fn, item) for item in work]

    def results() -> Iterator[R]:
        try:
            for fut in futures:
                yield fut.result()
        finally:
            for fut in futures:
                fut.cancel()

    return results()
