"""Host-to-device copies straight from the page cache: file mappings page-locked by the device driver.

A staged load (:mod:`.staging`) moves each byte through host memory four times: the kernel's copy into a pinned
buffer reads and writes it, the checksum reads it, the DMA reads it. A shared read-only mapping of the file,
page-locked by the driver, lets the checksum and the DMA read the page cache's own pages: two passes, and no
staging buffer. The driver locks page-cache pages for DMA (``benchmarks/probe_registered_mapping.py``,
docs/benchmarks/gpu.md), so a part of a load that is whole stored rows is:

1. mapped (shared, read-only) and verified over the mapped pages, checksum block by block, as every read is;
2. registered with the driver, read-only (no write fault, no copy-on-write) and portable (pinned for every context);
3. copied to its destination (or to a device scratch buffer it is scattered from) on the fill thread's stream;
4. unregistered and unmapped once that stream has passed the copy.

Registration goes through the CUDA driver API (``libcuda``, through ``ctypes``), not the runtime's
``cudaHostRegister``: a refusal there would stay in the runtime's last-error state, and the next kernel launch of
the same thread (a scatter's device-side copy) would raise it as its own error. Where there is no such driver
(a CPU-only machine, ROCm, a container without ``libcuda``) or it refuses a registration, the load stages as
before: :func:`registrar_for` is None, or :class:`MappedRows` turns itself off at the first refusal.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from .staging import Rows

log = logging.getLogger(__name__)

#: ``CU_MEMHOSTREGISTER_PORTABLE``: pinned for every context, not only the calling thread's current one.
_PORTABLE = 0x01
#: ``CU_MEMHOSTREGISTER_READ_ONLY``: the pages are only read by the device (a read-only mapping can be locked).
_READ_ONLY = 0x08


class Registrar(Protocol):
    """Page-locks host memory for DMA, and releases it."""

    def register(self, address: int, nbytes: int) -> bool:
        """Lock ``nbytes`` from ``address`` (a page-aligned read-only mapping) for DMA; False where refused."""
        ...

    def unregister(self, address: int) -> None:
        """Release a registration made at ``address``."""
        ...


class DriverRegistrar:
    """:class:`Registrar` through the CUDA driver API (``cuMemHostRegister``, read-only and portable). The calling
    thread needs a current context: a fill thread makes its device current before it copies."""

    def __init__(self, lib: Any):
        self._register = lib.cuMemHostRegister_v2
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cuMemHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int

    def register(self, address: int, nbytes: int) -> bool:
        code = self._register(address, nbytes, _PORTABLE | _READ_ONLY)
        if code:
            log.info("cuMemHostRegister of %d bytes refused (CUresult %d)", nbytes, code)
        return code == 0

    def unregister(self, address: int) -> None:
        code = self._unregister(address)
        if code:  # nothing more to do about it: the mapping goes next, and the driver drops its lock with it
            log.warning("cuMemHostUnregister at %#x failed (CUresult %d)", address, code)


@functools.cache
def _driver() -> DriverRegistrar | None:
    if torch.version.hip is not None:  # HIP's registration is not this library: ROCm loads stage
        return None
    try:
        return DriverRegistrar(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as e:
        log.info("no CUDA driver library for page-locked mappings (%s): device loads stage", e)
        return None


def registrar_for(device: torch.device) -> Registrar | None:
    """The registrar of loads into ``device``: the CUDA driver's where ``device`` is a CUDA GPU and the driver
    library loads, else None (the load stages every part)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _driver()


#: maps rows ``[lo, hi)`` of a stored piece, shared, verified: (mapping, where the rows begin, their bytes), or None.
MapRowsBytes = Callable[..., "tuple[Any, int, int] | None"]


class MappedRows:
    """A load's copies from page-locked mappings: :meth:`open` maps a part's rows (verified), registers the
    mapping and hands back a host tensor over its bytes and the release to call once the copies from it are
    done. The first refusal turns it off for the rest of the load (those parts, and the rest, stage)."""

    def __init__(self, map_rows_bytes: MapRowsBytes, registrar: Registrar):
        self._map = map_rows_bytes
        self._registrar = registrar
        self._lock = threading.Lock()
        self.on = True

    def open(self, rows: Rows) -> tuple[torch.Tensor, Callable[[], None]] | None:
        """Rows ``rows`` as a uint8 host tensor over a registered mapping of their file, verified, and the
        release of that registration; None where they cannot be (the storage maps nothing, a refusal)."""
        if not self.on:
            return None
        found = self._map(rows.ref, rows.lo, rows.hi, shared=True)  # verified: a corrupt block raises here
        if found is None:
            return None
        mapped, at, nbytes = found
        if not nbytes:
            return torch.empty(0, dtype=torch.uint8), _nothing
        # the mapping's address (it is page-aligned: what the driver locks); the numpy view goes at once
        base = np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data
        if not self._registrar.register(base, len(mapped)):
            with self._lock:
                if self.on:
                    self.on = False
                    log.info("device load: a mapping could not be page-locked; the rest of the load stages")
            return None
        # a writable view of the read-only pages (nothing writes to them): torch would warn at a read-only buffer
        host = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(base + at), dtype=torch.uint8)

        def release(mapping: Any = mapped) -> None:  # the mapping lives until the driver has let go of it
            self._registrar.unregister(base)
            del mapping

        return host, release


def _nothing() -> None:
    return None
