"""Tuning of the resharder: the offline run (:class:`ReshardOptions`) and a load (:class:`LoadOptions`).

Defaults are the settings measured best on the benchmark state (docs/benchmarks/README.md holds the figures):
small chunks offline, where writers read rows of the same stored pieces and a chunk shared by two writers must
not be read twice; large chunks at load time, where a box that is one whole chunk is kept without a copy.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, fields

from .runtime import cores_per_rank, host_cores

MiB = 1024 * 1024

#: offline: target files written in parallel, where the machine has the cores (:func:`offline_workers`).
OFFLINE_WORKERS = 4

#: offline: source pieces are read in row chunks of about this size (one checksum block, so that writers needing
#: different rows of one stored piece rarely share a chunk, and no block is read twice).
OFFLINE_CHUNK_BYTES = 4 * MiB
#: offline: byte budget of the chunk cache shared by all writers. On local disk its chunks are mappings of the
#: page cache, not copies; a smaller budget let the writers of a TP change with uneven dp outrun it, and the
#: chunks they shared were evicted and read again (docs/benchmarks/README.md, "Figures behind the code's defaults").
OFFLINE_CACHE_BYTES = 512 * MiB
#: offline: target pieces are assembled and written in row slabs of about this size.
SLAB_BYTES = 16 * MiB
#: offline: a backend that stores pieces one by one (zarr) is handed a writer's pieces in batches of this size.
WRITE_BATCH_BYTES = 64 * MiB
#: a writer (or a rank loading alone) with read-ahead threads keeps the reads of its next pieces, up to about
#: this many bytes, in flight.
PREFETCH_BYTES = 16 * MiB
#: a writer without read-ahead threads asks the kernel to read ahead the source rows of its next pieces, up to
#: about this many bytes (they go to the page cache, not the process: a wider window).
ADVISE_BYTES = 128 * MiB

#: load: source pieces are read in row chunks of about this size.
LOAD_CHUNK_BYTES = 64 * MiB
#: load into device memory: boxes are read in parts of about this size through pinned staging buffers, two per
#: fill thread (parts larger than a few checksum blocks gained nothing, and every byte of them is pinned memory).
LOAD_STAGE_BYTES = 16 * MiB
#: load into device memory: whole stored rows that land as they are are copied to the device straight from
#: page-locked mappings of their files in parts of about this size (registering a part costs per call as well as
#: per byte).
LOAD_MAPPED_BYTES = 64 * MiB
#: load: byte budget of a loading rank's chunk cache (beyond the state it returns).
LOAD_CACHE_BYTES = 256 * MiB
#: load: threads reading ahead of a loading rank.
LOAD_READ_THREADS = 2
#: load: at most this many threads per rank read boxes straight into their memory (pread and checksums release
#: the interpreter lock), and at least LOAD_FILL_THREADS_MIN (one reads while another hashes).
LOAD_FILL_THREADS_MAX = 8
LOAD_FILL_THREADS_MIN = 2
#: load, collective: ranks exchange at most about this many bytes per rank per round.
ROUND_BYTES = 128 * MiB


def load_fill_threads() -> int:
    """The default :attr:`LoadOptions.fill_threads`: the rank's share of the host's cores.

    Eight threads on each of four ranks of a 16-core host loaded slower than four (docs/benchmarks/README.md)."""
    return max(LOAD_FILL_THREADS_MIN, min(LOAD_FILL_THREADS_MAX, cores_per_rank()))


def _check_positive(obj: object, zero_turns_off: Collection[str] = (), flags: Collection[str] = ()) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.name in flags:
            if type(value) is not bool:
                raise ValueError(f"{type(obj).__name__}.{f.name} must be True or False, got {value!r}")
            continue
        least = 0 if f.name in zero_turns_off else 1
        if type(value) is not int or value < least:
            what = "a positive integer, or 0 (off)" if least == 0 else "a positive integer"
            raise ValueError(f"{type(obj).__name__}.{f.name} must be {what}, got {value!r}")


def offline_workers() -> int:
    """The default number of parallel writers of an offline run: :data:`OFFLINE_WORKERS`, fewer on a machine with
    fewer cores (on 2 cores, 4 forked writers took turns on them: an import ran slower than with 2)."""
    return max(1, min(OFFLINE_WORKERS, host_cores()))


def offline_options(workers: int | None = None, **limits: int) -> ReshardOptions:
    """:class:`ReshardOptions` with ``workers`` where given, else the default (:func:`offline_workers`)."""
    return ReshardOptions(**limits) if workers is None else ReshardOptions(workers=workers, **limits)


@dataclass(frozen=True, kw_only=True)
class ReshardOptions:
    """How an offline reshard (:func:`~moeckpt.reshard.executor.reshard`, ``write_rows``) uses memory and cores."""

    #: target files written in parallel (forked processes where backends and storages allow it, else threads).
    workers: int = field(default_factory=offline_workers)
    #: source pieces are read in row chunks of about this many bytes.
    chunk_bytes: int = OFFLINE_CHUNK_BYTES
    #: target pieces are assembled and written in row slabs of about this many bytes.
    slab_bytes: int = SLAB_BYTES
    #: byte budget of the chunk cache (shared by threads, split between processes).
    cache_bytes: int = OFFLINE_CACHE_BYTES
    #: a backend storing pieces one by one gets a writer's pieces in batches of about this many bytes.
    write_batch_bytes: int = WRITE_BATCH_BYTES
    #: bytes of the next pieces' reads kept in flight by the read-ahead threads.
    prefetch_bytes: int = PREFETCH_BYTES
    #: bytes of the next pieces' rows the kernel is asked to read ahead, where there are no read-ahead threads.
    advise_bytes: int = ADVISE_BYTES

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a load (:func:`~moeckpt.reshard.load.load_rank_state`) uses memory and threads on each rank."""

    #: source pieces are read in row chunks of about this many bytes (a box that is one whole chunk is kept as is).
    chunk_bytes: int = LOAD_CHUNK_BYTES
    #: byte budget of the rank's chunk cache, beyond the state it returns.
    cache_bytes: int = LOAD_CACHE_BYTES
    #: collective loads exchange at most about this many bytes per rank per round.
    round_bytes: int = ROUND_BYTES
    #: threads reading ahead of the rank.
    read_threads: int = LOAD_READ_THREADS
    #: threads reading boxes straight into their memory: by default the rank's share of the host's cores
    #: (:func:`~moeckpt.reshard.runtime.cores_per_rank`, when the options are made), within the bounds above.
    fill_threads: int = field(default_factory=load_fill_threads)
    #: bytes of the next boxes' reads kept in flight by the read-ahead threads.
    prefetch_bytes: int = PREFETCH_BYTES
    #: into device memory: boxes are read in parts of about this many bytes through pinned staging buffers.
    stage_bytes: int = LOAD_STAGE_BYTES
    #: into a CUDA device: whole stored rows are copied straight from the page cache (file mappings page-locked by
    #: the driver, :mod:`~moeckpt.reshard.page_lock`), those that land as they are in parts of about this many
    #: bytes (rows scattered into place keep ``stage_bytes``, which bounds the device scratch); 0 stages them all.
    mapped_bytes: int = LOAD_MAPPED_BYTES
    #: into a GPU where Triton is installed: whole checksum blocks are read unhashed and hashed where they land, on
    #: the device (:mod:`~moeckpt.reshard.device_checks`), instead of on the host before the copy. Off by default:
    #: on an idle 16-core host it was no faster, and a process's first load pays Triton's start
    #: (docs/benchmarks/gpu.md); it takes the hashing off the host's cores.
    checksums_on_device: bool = False

    def __post_init__(self) -> None:
        _check_positive(self, zero_turns_off=("mapped_bytes",), flags=("checksums_on_device",))
