"""Boxes: axis-aligned sub-blocks of a logical tensor.

Every piece of a checkpoint, whatever the parallel layout that wrote it, is a box ``(offsets, shape)`` of one
logical tensor. Resharding is box intersection, so keeping everything a box (never a flattened range) is what
lets any layout convert to any other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_new = object.__new__
_set = object.__setattr__


@dataclass(frozen=True, order=True)
class Box:
    """A box of a tensor: ``offsets[i] <= index[i] < offsets[i] + shape[i]`` in every dimension."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} must be non-negative")

    @classmethod
    def trusted(cls, offsets: tuple[int, ...], shape: tuple[int, ...]) -> Box:
        """A box without re-validating, for offsets and shape computed from valid boxes: the placement and the
        planner build millions at 1,024 ranks, and ``__post_init__``'s checks were a large part of their time."""
        b = _new(cls)
        _set(b, "offsets", offsets)
        _set(b, "shape", shape)
        return b

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def is_empty(self) -> bool:
        return self.numel == 0

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes, or ``None`` when they share no element.

        On plain tuples, one pass per dimension: the planner calls it for every source box a target box meets.
        """
        lo, size = [], []
        for ao, an, bo, bn in zip(self.offsets, self.shape, other.offsets, other.shape):
            start = ao if ao > bo else bo
            stop = min(ao + an, bo + bn)
            if stop <= start:
                return None
            lo.append(start)
            size.append(stop - start)
        return Box.trusted(tuple(lo), tuple(size))

    def contains(self, other: Box) -> bool:
        return all(a <= b for a, b in zip(self.offsets, other.offsets)) and all(
            a >= b for a, b in zip(self.end, other.end)
        )

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        """Index expression selecting this box from the full tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offsets, self.shape))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.end, shape))

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.shape)]

    @classmethod
    def from_json(cls, value: object) -> Box:
        if (
            not isinstance(value, list)
            or len(value) != 2
            or not all(isinstance(v, list) and all(type(i) is int for i in v) for v in value)
        ):
            raise ValueError(f"a box is [[offsets...], [shape...]] of integers, got {value!r}")
        return cls(tuple(value[0]), tuple(value[1]))


def covers_exactly_once(shape: Sequence[int], boxes: Iterable[Box]) -> str | None:
    """Check that ``boxes`` tile a tensor of ``shape`` with no gap and no overlap.

    Returns ``None`` when they do, else a sentence describing the first problem found. Works on the grid
    spanned by the box boundaries, so its cost depends on the number of boxes, not on the tensor size.
    """
    shape = tuple(shape)
    boxes = [b for b in boxes if not b.is_empty()]
    for b in boxes:
        if not b.within(shape):
            return f"box {b.to_json()} lies outside the tensor shape {list(shape)}"
    total = sum(b.numel for b in boxes)
    want = math.prod(shape)
    if total != want:
        kind = "overlap" if total > want else "leave gaps"
        return f"pieces hold {total} elements but the tensor has {want}: they {kind}"
    # Equal volume plus no pairwise overlap implies an exact cover. Sort-and-sweep on dim 0 keeps it cheap.
    ordered = sorted(boxes, key=lambda b: b.offsets)
    active: list[Box] = []
    for b in ordered:
        lo0 = b.offsets[0] if b.ndim else 0
        active = [a for a in active if (a.end[0] if a.ndim else 1) > lo0]
        for a in active:
            if a.intersect(b) is not None:
                return f"boxes {a.to_json()} and {b.to_json()} overlap"
        active.append(b)
    return None
