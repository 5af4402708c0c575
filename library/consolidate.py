"""Any checkpoint as Hugging Face sharded safetensors of full tensors (``moeckpt consolidate``).

What DCP's ``consolidate_safetensors_files`` does for its Hugging Face storage writer, for any moeckpt checkpoint:
a ``moeckpt.save`` of an arbitrary model (DTensors on any mesh), a ``moeckpt.dcp`` or ``import-dcp`` one, or the
bundled trainer's. No model plan is needed: every logical tensor of the index is written whole under its own name
(the state dict's flattened key), in its stored dtype, into ``model-0000k-of-0000n.safetensors`` shards of at most
``max_shard_size`` bytes with ``model.safetensors.index.json`` last (:mod:`moeckpt.formats.hf_shards`, the writer
``export-hf`` uses too). JSON values of the state dict (a step, ``param_groups``) are not tensors and stay in the
checkpoint.

Memory is bounded by a run of rows, not by a tensor or a shard: each tensor is read and written in runs of about
``slab_bytes`` (one row when a row is larger), cut where the stored pieces' rows begin and end, so a run that lies
in one piece full-width (an FSDP ``Shard(0)`` piece) is written straight from the bytes read; a run spread over
several pieces (a tensor-parallel ``Shard(1)``) is assembled into a run-sized buffer, one piece read at a time.
Tensor data held at once: one run plus one piece's rows read (widened to whole checksum blocks), each dropped
before the next is made. Every byte read is verified against the checkpoint's block checksums
(:meth:`~moeckpt.formats.checkpoint.CheckpointReader.read_piece`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.hf_shards import HfExportError, ShardTensor, pack_shards, write_shards
from moeckpt.formats.pieces import PieceRef, tensor_bytes

__all__ = ["DEFAULT_SLAB_BYTES", "ConsolidateResult", "consolidate"]

log = logging.getLogger(__name__)

#: rows of a tensor read and written at once (a row larger than this is one run on its own).
DEFAULT_SLAB_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote, and the most tensor data it held at once."""

    files: tuple[str, ...]
    total_size: int
    num_tensors: int
    #: the largest run of rows held at once (an assembled slab or the rows of one piece read).
    peak_slab_bytes: int
    seconds: float


def consolidate(
    ckpt: str,
    out: str,
    *,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> ConsolidateResult:
    """Write every tensor of checkpoint ``ckpt`` (or a run directory's newest step) whole, under its own name,
    as Hugging Face sharded safetensors at ``out`` (local path or URL).

    Shards hold at most ``max_shard_size`` bytes (a larger tensor gets a shard of its own); the index is
    written last, and on local disk the directory is staged and renamed into place, so an interrupted or failed
    run leaves nothing at ``out``. A non-empty ``out`` is refused unless ``overwrite``. ``on_bytes`` is called
    with the bytes of each run written (progress bars)."""
    if slab_bytes < 1:
        raise ValueError(f"slab_bytes must be positive, got {slab_bytes}")
    started = time.perf_counter()
    reader = CheckpointReader(ckpt)
    entries = reader.index.tensors
    if not entries:
        raise HfExportError(f"{reader.location}: the checkpoint holds no tensors to consolidate")
    refs: dict[str, list[PieceRef]] = {name: [] for name in entries}
    for ref in reader.pieces():
        refs[ref.tensor].append(ref)
    shards = pack_shards((ShardTensor(n, e.dtype, tuple(e.shape)) for n, e in entries.items()), max_shard_size)
    peak = [0]

    def produce(t: ShardTensor) -> Iterator[memoryview]:
        for rows in _runs(t, refs[t.name], slab_bytes):
            data = _read_run(reader, t, rows, refs[t.name])
            peak[0] = max(peak[0], data.nbytes)
            yield tensor_bytes(data)
            del data  # before the next run is read (the writer drops its view of it too)

    written = write_shards(out, shards, produce, overwrite=overwrite, on_bytes=on_bytes)
    result = ConsolidateResult(
        written.files, written.total_size, written.num_tensors, peak[0], time.perf_counter() - started
    )
    log.info(
        "consolidated %s to %s: %d tensors, %d shards, %d bytes in %.2f s (largest run held %d bytes)",
        reader.location,
        out,
        result.num_tensors,
        len(result.files),
        result.total_size,
        result.seconds,
        result.peak_slab_bytes,
    )
    return result


def _runs(t: ShardTensor, refs: list[PieceRef], slab_bytes: int) -> Iterator[tuple[int, int] | None]:
    """Row ranges ``[r0, r1)`` of ``t`` to read and write in turn (``None``: a 0-d tensor, read whole): about
    ``slab_bytes`` each, never crossing a row where a stored piece begins or ends."""
    if not t.shape:
        yield None
        return
    rows = t.shape[0]
    if rows == 0 or t.nbytes == 0:
        return
    step = max(1, slab_bytes // (t.nbytes // rows))
    cuts = sorted({0, rows} | {c for r in refs for c in (r.box.offsets[0], r.box.offsets[0] + r.box.shape[0])})
    for lo, hi in zip(cuts, cuts[1:]):
        for r0 in range(lo, hi, step):
            yield r0, min(hi, r0 + step)


def _read_run(reader: CheckpointReader, t: ShardTensor, rows: tuple[int, int] | None, refs: list[PieceRef]):
    """Rows ``rows`` of tensor ``t``, checksums verified: the bytes read themselves when one stored piece holds
    them full-width, else assembled from every piece they overlap."""
    if rows is None:
        return reader.read_box(t.name, Box((), ()), refs)
    r0, r1 = rows
    box = Box((r0,) + (0,) * (len(t.shape) - 1), (r1 - r0,) + t.shape[1:])
    for ref in refs:
        if (
            ref.box.shape[1:] == t.shape[1:]
            and ref.box.offsets[0] <= r0
            and r1 <= ref.box.offsets[0] + ref.box.shape[0]
        ):
            start = ref.box.offsets[0]
            data: torch.Tensor = reader.read_piece(ref, (r0 - start, r1 - start))
            return data
    return reader.read_box(t.name, box, refs)
