"""Checksums of a device load computed on the device: the bytes are verified where they land.

A load into GPU memory used to hash every byte on the host before copying it: the checksum pass is a second read
of every byte from host memory, and on a 16-core host it was most of the load's CPU time (docs/benchmarks/gpu.md).
Here the load reads whole checksum blocks into pinned staging unhashed, copies them to the device, and a kernel on
the same stream computes each block's xxh3 accumulators there (:mod:`moeckpt.formats.xxh3_parts` splits xxh3-64
into those and a digest the host finishes). Once the load's streams have finished, :meth:`DeviceChecks.verify`
finishes every block's digest and compares it with the index's checksum: a corrupt block raises
:class:`~moeckpt.formats.errors.ChecksumMismatchError` naming the file, tensor and block, as a host check does,
before the load returns. (The destination then holds what the files held: a failed load's tensors are not to be
used, as after any failed load.)

Off by default (``LoadOptions.checksums_on_device``): measured side by side on a 16-core H100 host, a load that
hashes on the device took 0.88-1.09x the time of one that hashes on the host (the load is bound elsewhere: its
per-part work on 8 threads), and a process's first load paid about a second of Triton's start; what it buys is
the hashing's host CPU time (docs/benchmarks/gpu.md).

The kernel is written in Triton, which runs on CUDA and ROCm GPUs alike. Where there is no Triton or no GPU,
:func:`accumulator_for` is None and every byte is hashed on the host as before. Blocks of at most
:data:`~moeckpt.formats.xxh3_parts.LONG_INPUT_BYTES` bytes (xxh3's short-input paths) and sliced pieces (per-slice
checksums) are checked on the host too: :meth:`DeviceChecks.takes` says which rows go to the device.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from moeckpt.formats.checksum import is_checksum
from moeckpt.formats.pieces import PieceRef, block_span, check_block
from moeckpt.formats.xxh3_parts import (
    INIT,
    LAST_KEYS,
    LONG_INPUT_BYTES,
    SCRAMBLE_KEYS,
    STRIPE_KEYS,
    checksum_of,
)

from .staging import Rows

log = logging.getLogger(__name__)

#: accumulate(data, first, nbytes, count): the accumulators of ``count`` inputs of ``nbytes`` bytes each, back to
#: back from byte ``first`` of ``data`` (uint8, contiguous), as a ``(count, 8)`` int64 tensor (the bits of the
#: unsigned accumulators), computed in stream order on ``data``'s device.
Accumulate = Callable[[torch.Tensor, int, int, int], torch.Tensor]


class DeviceChecks:
    """A load's checksum blocks hashed on the device: :meth:`add` queues the hashing of rows landed there (on the
    calling thread's current stream), :meth:`verify` compares the digests once every stream has finished."""

    def __init__(self, accumulate: Accumulate, where: Callable[[str], str] = str):
        self._accumulate = accumulate
        self._where = where
        #: per run of blocks hashed: (the piece, its first block, the blocks' bytes each, how many, accumulators)
        self._pending: list[tuple[PieceRef, int, int, int, torch.Tensor]] = []
        self._lock = threading.Lock()

    @staticmethod
    def takes(ref: PieceRef, lo: int, hi: int) -> bool:
        """Whether rows ``[lo, hi)`` of ``ref`` are whole xxh3 checksum blocks the device can hash: a piece with
        blocks and no slices, the rows starting and ending on block edges, every block longer than xxh3's short
        inputs."""
        if ref.geometry is not None or not ref.block_bytes or not ref.box.ndim or hi <= lo:
            return False
        if not ref.checksums or not is_checksum(ref.checksums[0]):
            return False
        a, b, _, read_lo, read_hi = block_span(ref, lo, hi)
        if (a, b) != (read_lo, read_hi):
            return False
        last = (b - a) % ref.block_bytes or ref.block_bytes  # the length of the rows' last block
        return last > LONG_INPUT_BYTES

    def add(self, data: torch.Tensor, rows: Rows) -> None:
        """Hash ``data`` (the bytes of ``rows``, contiguous, where they landed) block by block on its stream."""
        ref = rows.ref
        a, b, b0, _, _ = block_span(ref, rows.lo, rows.hi)
        block = ref.block_bytes
        whole, rest = divmod(b - a, block)
        if data.numel() * data.element_size() != b - a:
            raise ValueError(f"device checks: {data.numel()} bytes landed for rows of {b - a} bytes")
        flat = data.reshape(-1).view(torch.uint8)
        runs = []
        if whole:
            runs.append((ref, b0, block, whole, self._accumulate(flat, 0, block, whole)))
        if rest:
            runs.append((ref, b0 + whole, rest, 1, self._accumulate(flat, whole * block, rest, 1)))
        with self._lock:
            self._pending += runs

    def verify(self) -> None:
        """Compare every queued block's digest with its recorded checksum (the streams that hashed them have
        finished); the first mismatch raises."""
        with self._lock:
            runs, self._pending = self._pending, []
        if not runs:
            return
        # every run's accumulators in one copy to the host, not one (and its synchronisation) per run
        accs = torch.cat([acc for *_, acc in runs]).cpu().numpy().view(np.uint64)
        row = 0
        for ref, first, nbytes, count, _ in runs:
            for i in range(count):
                check_block(ref, first + i, checksum_of(accs[row + i].tolist(), nbytes), self._where(ref.file))
            row += count


@functools.cache
def _kernel() -> Any:
    """The Triton kernel (compiled on first use), or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def xxh3_accumulators(src, first, n, keys, last, scramble, init, out, ALIGNED: tl.constexpr):
        # one program per input: ``n`` bytes from ``first + program * n``; a block of 16 stripes x 8 lanes per step
        pid = tl.program_id(0)
        start = first + pid.to(tl.int64) * n
        stripe = tl.arange(0, 16)[:, None]
        lane = tl.arange(0, 8)[None, :]
        byte = tl.arange(0, 8)[None, None, :]
        shift = byte.to(tl.uint64) * 8
        k = tl.arange(0, 8)
        key = tl.load(keys + stripe * 8 + lane)
        acc = tl.load(init + k)
        scramble_key = tl.load(scramble + k)
        low = tl.full((16, 8), 0xFFFFFFFF, tl.uint64)
        words = src.to(tl.pointer_type(tl.uint64))
        blocks = (n - 1) // 1024
        for b in range(0, blocks):
            at = start + b * 1024
            if ALIGNED:  # whole words: the input starts on an 8-byte boundary
                w = tl.load(words + at // 8 + stripe * 8 + lane)
                ws = tl.load(words + at // 8 + stripe * 8 + (lane ^ 1))
            else:  # byte by byte, little-endian
                w = tl.sum(tl.load(src + at + (stripe * 64 + lane * 8)[:, :, None] + byte).to(tl.uint64) << shift, 2)
                ws = tl.sum(
                    tl.load(src + at + (stripe * 64 + (lane ^ 1) * 8)[:, :, None] + byte).to(tl.uint64) << shift, 2
                )
            keyed = w ^ key
            acc = acc + tl.sum((keyed & low) * (keyed >> 32), axis=0) + tl.sum(ws, axis=0)
            acc = acc ^ (acc >> 47)
            acc = acc ^ scramble_key
            acc = acc * 0x9E3779B1  # xxh3's PRIME32_1 (formats.xxh3_parts.SCRAMBLE_PRIME)
        # the last block's whole stripes (fewer than 16), then the input's last 64 bytes with their own key
        at = start + blocks * 1024
        stripes = ((n - 1) - blocks * 1024) // 64
        live = stripe < stripes
        mask = live[:, :, None] & (byte >= 0)
        w = tl.sum(tl.load(src + at + (stripe * 64 + lane * 8)[:, :, None] + byte, mask=mask, other=0).to(tl.uint64)
                   << shift, 2)  # fmt: skip
        ws = tl.sum(tl.load(src + at + (stripe * 64 + (lane ^ 1) * 8)[:, :, None] + byte, mask=mask, other=0)
                    .to(tl.uint64) << shift, 2)  # fmt: skip
        keyed = w ^ key
        products = tl.where(live & (lane >= 0), (keyed & low) * (keyed >> 32), tl.zeros((16, 8), tl.uint64))
        acc = acc + tl.sum(products, axis=0) + tl.sum(ws, axis=0)
        at = start + n - 64
        word = tl.arange(0, 8)[:, None]
        b1 = tl.arange(0, 8)[None, :]
        w1 = tl.sum(tl.load(src + at + word * 8 + b1).to(tl.uint64) << (b1.to(tl.uint64) * 8), 1)
        ws1 = tl.sum(tl.load(src + at + (word ^ 1) * 8 + b1).to(tl.uint64) << (b1.to(tl.uint64) * 8), 1)
        keyed1 = w1 ^ tl.load(last + k)
        acc = acc + (keyed1 & 0xFFFFFFFF) * (keyed1 >> 32) + ws1
        tl.store(out + pid * 8 + k, acc.to(tl.int64, bitcast=True))

    return xxh3_accumulators


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The secret's key tables and the accumulators' start on ``device``, made once per device."""
    return tuple(
        torch.from_numpy(np.asarray(values, dtype=np.uint64).reshape(-1).view(np.int64).copy())
        .to(device)
        .view(torch.uint64)
        for values in (STRIPE_KEYS, LAST_KEYS, SCRAMBLE_KEYS, INIT)
    )


def triton_accumulate(data: torch.Tensor, first: int, nbytes: int, count: int) -> torch.Tensor:
    """:data:`Accumulate` by the Triton kernel, on ``data``'s device and its current stream."""
    kernel = _kernel()
    out = torch.empty((count, 8), dtype=torch.int64, device=data.device)
    aligned = (data.data_ptr() + first) % 8 == 0 and (count == 1 or nbytes % 8 == 0)
    keys, last, scramble, init = _tables(data.device)
    kernel[(count,)](data, first, nbytes, keys, last, scramble, init, out, ALIGNED=aligned)
    return out


def accumulator_for(device: torch.device) -> Accumulate | None:
    """How a load into ``device`` hashes on the device: the Triton kernel on a GPU where Triton is installed, else
    None (the load hashes on the host)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if _kernel() is None:
        log.info("device load: Triton is not installed; checksums are computed on the host")
        return None
    return triton_accumulate
