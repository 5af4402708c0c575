"""What a reshard plan is: the stored source pieces, the reads that fill each target box, and the boxes and bytes
of each planned rank or writer.

Plain values, built by :mod:`.planner` (which decides them) and consumed by the executors: the offline run
(:mod:`.executor`), the loads (:mod:`.load`, :mod:`.box_load`) and the exchange plans (:mod:`.group_plan`). Every
:class:`ReadItem` names a source piece, the rows of it to read, and the region (global coordinates) that lands in a
target box. A :class:`SourcePiece` is a stored piece, not a file: a safetensors writer is a file, a zarr writer a
set of chunks; either backend lists the stored pieces of a writer, so one plan serves both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from moeckpt.formats.box import Box
from moeckpt.formats.index import Index

from .layout import Layout
from .placement import placements


@dataclass(frozen=True)
class SourcePiece:
    """A stored piece of the source checkpoint: a box of a tensor and the writer whose file (or chunks) hold it."""

    tensor: str
    box: Box
    writer: int


def _eq(self: tuple, other: object) -> bool:
    """A plan value equals only a value of its own class with equal fields, as a frozen dataclass does (a tuple
    subclass would equal any tuple of its fields; ``False``, not ``NotImplemented``, stops the tuple's)."""
    return other.__class__ is self.__class__ and tuple.__eq__(self, other)


def _ne(self: tuple, other: object) -> bool:
    return not _eq(self, other)


def _unordered(self: tuple, other: object) -> bool:
    raise TypeError(f"{type(self).__name__} values have no order")


_T = TypeVar("_T", bound=type)


def _plan_value(cls: _T) -> _T:
    """A named tuple that compares like a frozen dataclass: equal only to its own class, unordered (its hash, the
    tuple's of its fields, is the dataclass's already). Set after the class is made: a NamedTuple body takes
    fields only."""
    methods = {"__eq__": _eq, "__ne__": _ne} | dict.fromkeys(("__lt__", "__le__", "__gt__", "__ge__"), _unordered)
    for name, method in methods.items():
        setattr(cls, name, method)
    return cls


@_plan_value
class ReadItem(NamedTuple):
    """Copy ``region`` (global coordinates) of ``tensor`` from a stored source piece into a target box.

    A named tuple, not a frozen dataclass, because an offline plan at 1,024 writers builds millions and a tuple's
    constructor runs in C (``tuple.__new__(ReadItem, fields)``); it compares and hashes as the dataclass did."""

    tensor: str
    #: the stored piece read from, and its writer.
    src_box: Box
    writer: int
    #: the elements copied, in global coordinates: ``src_box ∩ target_box``.
    region: Box
    #: the target box the region lands in.
    target_box: Box

    @property
    def source(self) -> SourcePiece:
        return SourcePiece(self.tensor, self.src_box, self.writer)

    @property
    def rows(self) -> tuple[int, int]:
        """Rows ``[r0, r1)`` of the stored piece (its dim 0, piece coordinates) that hold the region."""
        if not self.src_box.ndim:
            return (0, 1)
        r0 = self.region.offsets[0] - self.src_box.offsets[0]
        return (r0, r0 + self.region.shape[0])


@_plan_value
class TargetPiece(NamedTuple):
    """One box a target rank holds (load) or writes (offline), with the reads that fill it exactly (a named tuple
    for the reason :class:`ReadItem` is one)."""

    tensor: str
    box: Box
    reads: tuple[ReadItem, ...]


@dataclass(frozen=True)
class RankPlan:
    """What one target rank (load) or writer (offline) needs and reads."""

    rank: int
    pieces: tuple[TargetPiece, ...]
    #: bytes of the target boxes (what the rank needs).
    nbytes: int
    #: bytes of source rows read, each stored row counted once (what a rank reading alone fetches).
    read_nbytes: int


@dataclass(frozen=True)
class ReshardPlan:
    """A whole plan: the source and target layouts and one :class:`RankPlan` per planned rank or writer."""

    source: Layout
    target: Layout
    #: ``"reshard"`` (pieces each target writer stores) or ``"load"`` (boxes each target rank holds).
    kind: str
    ranks: tuple[RankPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    @property
    def read_nbytes(self) -> int:
        """Source bytes read if every planned rank reads its own rows (no sharing between ranks)."""
        return sum(r.read_nbytes for r in self.ranks)

    def rank(self, rank: int) -> RankPlan:
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(f"rank {rank} is not in this plan (planned: {[r.rank for r in self.ranks][:8]}...)")


def source_layout(index: Index) -> Layout:
    """The layout the source checkpoint was written in (empty for a state dict's meshes)."""
    return Layout.from_json(index.layout)


def source_pieces(index: Index, tensors: Iterable[str] | None = None) -> dict[str, list[SourcePiece]]:
    """Every stored piece of the source, located from the index alone (layout + sharding rules)."""
    layout = source_layout(index)
    names = index.tensors if tensors is None else tensors
    return {
        name: [SourcePiece(name, p.box, p.writer) for p in placements(index.tensors[name], layout)] for name in names
    }
