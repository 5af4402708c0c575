"""Parallel layouts: tensor (tp), expert (ep) and data (dp) parallel degrees, and the rank numbering.

World size is ``tp * dp``. Ranks are numbered with TP innermost, ``rank = dp_rank * tp + tp_rank``, so a TP group is
a run of consecutive ranks (one node's fast links, as Megatron lays it out). Experts are split over ``ep`` ranks
inside the data-parallel dimension: ``dp_rank = edp_rank * ep + ep_rank``, so the expert-parallel group is
consecutive data-parallel ranks and the ``dp / ep`` ranks with the same ``(tp_rank, ep_rank)`` hold replicas of the
same experts (the expert-data-parallel group, over which ZeRO-1 splits expert optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeckpt.formats.errors import LayoutError


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A (tp, ep, dp) parallel layout."""

    #: tensor-parallel degree: attention heads, MLP and vocabulary are split tp ways.
    tp: int = 1
    #: expert-parallel degree: each expert lives on one of ep ranks; must divide dp.
    ep: int = 1
    #: data-parallel degree: replicas of the model; ZeRO-1 splits optimizer state across them.
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "dp"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise LayoutError(f"layout: {name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise LayoutError(
                f"layout: ep={self.ep} must divide dp={self.dp} (expert parallelism splits the data-parallel ranks)"
            )

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree: replicas of each expert shard."""
        return self.dp // self.ep

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside world size {self.world} of layout {self}")
        dp_rank, tp_rank = divmod(rank, self.tp)
        edp_rank, ep_rank = divmod(dp_rank, self.ep)
        return RankCoords(rank=rank, tp_rank=tp_rank, dp_rank=dp_rank, ep_rank=ep_rank, edp_rank=edp_rank)

    def rank_of(self, *, tp_rank: int, dp_rank: int) -> int:
        return dp_rank * self.tp + tp_rank

    def to_json(self) -> dict[str, int]:
        return {"tp": self.tp, "ep": self.ep, "dp": self.dp}

    @classmethod
    def from_json(cls, value: dict) -> Layout:
        unknown = set(value) - {"tp", "ep", "dp"}
        if unknown:
            raise LayoutError(f"layout has unknown keys {sorted(unknown)}; expected tp, ep, dp")
        return cls(tp=value.get("tp", 1), ep=value.get("ep", 1), dp=value.get("dp", 1))

    def __str__(self) -> str:
        return f"tp={self.tp} ep={self.ep} dp={self.dp}"


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in a layout."""

    rank: int
    tp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
