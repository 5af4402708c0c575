"""A torch DCP checkpoint as the source of an offline conversion: its chunks become stored pieces of our tensors.

A mapping (``--mapping none``, torchtitan, Megatron) says where each part of a DCP tensor goes as a list of
:class:`Slot`: a box of the source tensor, the logical tensor it becomes and where it lands there (leading source
dims of size 1 may be dropped: Megatron stacks layers along dim 0). Every stored DCP chunk is then cut by the
slots into *virtual pieces* of the target tensors: :class:`~moeckpt.formats.pieces.PieceRef` values whose bytes
are a contiguous range of the ``.distcp`` file. The offline executor plans from those pieces as from any stored
checkpoint and reads their rows through its bounded chunk cache, in parallel: memory stays a few chunks, each
byte of a DCP chunk is read once, and the target may be any layout and format. No tensor is assembled whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box, covers_exactly_once
from moeckpt.formats.dcp import DcpCheckpoint, DcpFormatError, StoredChunk
from moeckpt.formats.index import Index
from moeckpt.formats.pieces import PieceRef

from .layout import Layout

#: a slot that cuts a chunk into more contiguous pieces than this is refused (it would be millions of tiny reads).
MAX_PIECES_PER_CHUNK = 65536


@dataclass(frozen=True)
class Slot:
    """Part ``region`` of DCP tensor ``source`` becomes the box at ``offsets`` of logical tensor ``target``.

    The first ``drop`` dims of ``region`` have size 1 and are dropped (a layer of a stacked tensor), and ``lift``
    dims of size 1 are put in front (one expert of a fused expert tensor): the box filled has shape
    ``(1,) * lift + region.shape[drop:]``. With ``transpose`` the last two dims of a tensor of three or more swap
    places (torchtitan's gpt-oss experts are ``[E, out, in]`` where the plan's are ``[E, in, out]``): dim 0 stays,
    so a row of the target is still one contiguous run of source bytes, transposed as it is read.
    """

    source: str
    region: Box
    target: str
    offsets: tuple[int, ...]
    drop: int = 0
    lift: int = 0
    transpose: bool = False

    def __post_init__(self) -> None:
        if any(s != 1 for s in self.region.shape[: self.drop]) or (
            len(self.offsets) != self.region.ndim - self.drop + self.lift
        ):
            raise ValueError(f"slot {self}: dropped dims must have size 1 and offsets match the target's dims")
        if self.transpose and (self.drop or self.lift or self.region.ndim < 3):
            raise ValueError(f"slot {self}: a transposed slot keeps its dims (no drop or lift) and has three or more")

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the box of the target this slot fills."""
        shape = (1,) * self.lift + self.region.shape[self.drop :]
        return _swapped(shape) if self.transpose else shape


def _swapped(t: tuple[int, ...]) -> tuple[int, ...]:
    """``t`` with its last two entries swapped (the shape or offsets of a transposed box)."""
    return (*t[:-2], t[-1], t[-2])


def whole(source: str, shape: Sequence[int], target: str | None = None) -> Slot:
    """The slot copying a whole DCP tensor into a tensor of the same shape."""
    return Slot(source, Box.full(shape), target or source, (0,) * len(shape))


def _contiguous_parts(rel: Box, outer: tuple[int, ...]) -> Iterable[Box]:
    """Split box ``rel`` of a C-ordered array of shape ``outer`` into boxes that are each contiguous in memory."""
    nd = len(outer)
    # dims after `p` must be whole; dims before `p` are iterated one index at a time.
    p = nd - 1
    while p > 0 and rel.shape[p] == outer[p] and rel.offsets[p] == 0:
        p -= 1
    lead = rel.shape[:p]
    if all(s == 1 for s in lead):
        yield rel
        return
    count = math.prod(lead)
    if count > MAX_PIECES_PER_CHUNK:
        raise DcpFormatError(f"a mapping cuts one chunk into {count} pieces; refusing (map whole rows instead)")
    for flat in range(count):
        idx, rest = [], flat
        for s in reversed(lead):
            idx.append(rest % s)
            rest //= s
        idx.reverse()
        yield Box(tuple(rel.offsets[i] + idx[i] for i in range(p)) + rel.offsets[p:], (1,) * p + rel.shape[p:])


def _linear(offsets: tuple[int, ...], shape: tuple[int, ...]) -> int:
    pos = 0
    for o, s in zip(offsets, shape):
        pos = pos * s + o
    return pos


#: a virtual piece whose rows are stored transposed (:attr:`Slot.transpose`): (tensor, file, start).
PieceKey = tuple[str, str, int]


def virtual_pieces(
    chunks: Mapping[str, Sequence[StoredChunk]], slots: Sequence[Slot], index: Index
) -> tuple[list[PieceRef], frozenset[PieceKey]]:
    """Every stored chunk cut by ``slots`` into pieces of ``index``'s tensors, and the keys of the pieces whose
    rows are stored transposed; checks each tensor is covered once."""
    by_source: dict[str, list[Slot]] = {}
    for s in slots:
        by_source.setdefault(s.source, []).append(s)
    refs: list[PieceRef] = []
    transposed: set[PieceKey] = set()
    for source, its_slots in by_source.items():
        for chunk in chunks[source]:
            item = dtypes.itemsize(chunk.dtype)
            for slot in its_slots:
                entry = index.tensors[slot.target]
                if entry.dtype != chunk.dtype:
                    raise DcpFormatError(f"{source}: stored as {chunk.dtype}, but {slot.target} is {entry.dtype}")
                sub = chunk.box.intersect(slot.region) if chunk.box.ndim else chunk.box
                if sub is None or sub.is_empty():
                    continue
                if slot.transpose and sub.shape[-2:] != chunk.box.shape[-2:]:
                    # a row is transposed whole: it must be whole in the chunk, one contiguous run
                    raise DcpFormatError(
                        f"{source}: a chunk split along its last two dims ({list(chunk.box.shape)} of "
                        f"{list(slot.region.shape)}) cannot be read transposed into {slot.target}"
                    )
                for part in _contiguous_parts(sub.relative_to(chunk.box), chunk.box.shape):
                    start = chunk.start + _linear(part.offsets, chunk.box.shape) * item
                    glob = [o + c for o, c in zip(part.offsets, chunk.box.offsets)]
                    rel = tuple([0] * slot.lift + [g - r for g, r in zip(glob, slot.region.offsets)][slot.drop :])
                    shape = (1,) * slot.lift + part.shape[slot.drop :]
                    if slot.transpose:
                        rel, shape = _swapped(rel), _swapped(shape)
                        transposed.add((slot.target, chunk.file, start))
                    box = Box(tuple(o + r for o, r in zip(slot.offsets, rel)), shape)
                    refs.append(
                        PieceRef(slot.target, box, chunk.dtype, chunk.file, start, box.numel * item, (), block_bytes=0)
                    )
    boxes: dict[str, list[Box]] = {name: [] for name in index.tensors}
    for r in refs:
        boxes[r.tensor].append(r.box)
    for name, entry in index.tensors.items():
        problem = covers_exactly_once(entry.shape, boxes[name])
        if problem is not None:
            raise DcpFormatError(f"tensor {name!r} is not covered exactly once by the mapped DCP chunks: {problem}")
    return refs, frozenset(transposed)


class DcpPieceReader:
    """A :class:`~moeckpt.formats.backend.PieceReader` over the virtual pieces of a DCP checkpoint: what the
    offline executor reads rows through."""

    def __init__(self, dcp: DcpCheckpoint, index: Index, transposed: frozenset[PieceKey] = frozenset()):
        """``transposed``: the pieces whose rows are stored with their last two dims swapped
        (:func:`virtual_pieces`); they are read, then transposed."""
        self.dcp = dcp
        self.index = index
        self.transposed = transposed
        self.location = dcp.location
        # Forked writers (local files only: fsspec filesystems hold event-loop threads a fork would inherit dead)
        # run in groups that share the DCP chunks they read (reshard/sharing.py), so each chunk is still read once.
        self.fork_safe = dcp.storage.fork_safe

    def _span(self, ref: PieceRef, lo: int, hi: int) -> tuple[tuple[int, ...], int]:
        """The shape the rows ``[lo, hi)`` of ``ref`` are stored in, and their first byte."""
        shape, start = ref.box.shape, ref.start
        if shape:
            start += lo * (ref.nbytes // shape[0] if shape[0] else 0)
            shape = (hi - lo,) + shape[1:]
        if self._is_transposed(ref):
            shape = _swapped(shape)
        return shape, start

    def _is_transposed(self, ref: PieceRef) -> bool:
        return bool(self.transposed) and (ref.tensor, ref.file, ref.start) in self.transposed

    def read_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor:
        shape, start = self._span(ref, lo, hi)
        out = torch.empty(shape, dtype=dtypes.to_torch(ref.dtype))
        self.dcp.read_into(ref.file, start, out)
        if self._is_transposed(ref):
            return out.transpose(-2, -1).contiguous()  # the writers take C-ordered rows of the target's shape
        return out

    def map_rows(self, ref: PieceRef, lo: int, hi: int) -> torch.Tensor | None:
        if not self.dcp.storage.is_local or self._is_transposed(ref):
            return None  # a transposed piece is read (and copied into the target's order), not mapped
        # Mapped, not read: the writers copy straight from the page cache (an offline conversion only; nothing of
        # a training rank's state is ever backed by a file).
        shape, start = self._span(ref, lo, hi)
        return self.dcp.map_bytes(ref.file, start, shape, ref.dtype)

    def advise(self, ref: PieceRef, lo: int, hi: int) -> None:
        # The writers copy from mapped pages: without the hint each page is read when first touched, the disk
        # waiting on the copy and the copy on the disk.
        shape, start = self._span(ref, lo, hi)
        self.dcp.advise(ref.file, start, math.prod(shape) * dtypes.itemsize(ref.dtype))

    def close(self) -> None:
        return None


def write_from_dcp(
    dcp: DcpCheckpoint,
    index: Index,
    slots: Sequence[Slot],
    dst: str,
    target: Layout,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    targets: Mapping[str, Sequence[tuple[Box, int]]] | None = None,
) -> tuple[Index, int]:
    """Write ``index``'s tensors, filled from ``dcp`` through ``slots``, to ``dst`` in layout ``target``; commit.

    ``targets`` places the pieces of tensors with stored-piece shardings (the DCP chunks kept as they are).
    Returns the committed index and the bytes read from the DCP files. The one place the offline executor is
    called for a DCP source.
    """
    from . import executor
    from .options import offline_options

    sources = sorted({s.source for s in slots})
    refs, transposed = virtual_pieces(dcp.chunks(sources), slots, index)
    new_index, _plan, bytes_read = executor.convert(
        executor.OfflineSource(DcpPieceReader(dcp, index, transposed), refs),
        index,
        dst,
        target,
        backend=index.backend,
        compress=index.compress,
        overwrite=overwrite,
        on_bytes=on_bytes,
        options=offline_options(workers),
        targets=targets,
    )
    return new_index, bytes_read


_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def kept_chunks(dcp: DcpCheckpoint, names: Sequence[str]) -> dict[str, list[tuple[Box, int]]]:
    """Each tensor's DCP chunks as the pieces to write, each by the rank whose ``__R_N.distcp`` file held it."""
    out: dict[str, list[tuple[Box, int]]] = {}
    for name, chunks in dcp.chunks(list(names)).items():
        pieces = []
        for c in chunks:
            m = _RANK_FILE.fullmatch(c.file.rsplit("/", 1)[-1])
            pieces.append((c.box, int(m.group(1)) if m else 0))
        out[name] = pieces
    return out
