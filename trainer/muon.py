"""Muon with ZeRO-1 partitioning: hidden weight matrices orthogonalized whole, everything else AdamW.

The parameters a model plan marks with ``ParamSpec.matrix`` (attention projections, dense and expert MLP matrices;
``docs/trainer.md`` lists the rule of every tensor and why) are stepped by Muon, all others by AdamW, with one
learning rate and one decoupled weight decay. Each rank keeps the ZeRO-1 layout of :mod:`moeckpt.trainer.zero`:
gradients reduce-scattered to the owners exactly as for AdamW, the momentum buffer stored as the owned boxes of the
checkpoint role ``momentum`` (like ``exp_avg``), the parameters all-gathered at the end. In between, per matrix:

1. ``momentum.lerp_(grad, 1 - mu)``; Nesterov: ``update = grad.lerp(momentum, mu)`` (``torch.optim.Muon`` and
   Keller Jordan's arithmetic);
2. the owned parts of ``update`` (cast to the Newton-Schulz dtype, bf16) meet at the rank(s) that orthogonalize the
   whole logical matrix (:mod:`moeckpt.trainer.muon_plan`: ``assign`` or ``gather``), over one all-to-all of the
   world; every expert's gate, up and down matrix is a matrix of its own, batched with all others of its shape;
3. the quintic Newton-Schulz iteration (coefficients 3.4445, -4.7750, 2.0315) in bf16;
4. the results return to the owners (``assign``: a second all-to-all), which apply
   ``p *= 1 - lr * weight_decay; p -= lr * 0.2 * sqrt(max(rows, cols)) * O`` to their fp32 part (Moonlight's
   scale: the update's RMS matches AdamW's, so one learning rate serves both).

At one rank there is nothing to exchange: the matrices are stacked by shape and orthogonalized in a plain loop.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from moeckpt.formats.errors import LayoutError
from moeckpt.formats.roles import MOMENT_ROLES, MUON_ROLES
from moeckpt.reshard.tensors import ParamSpec

from .adamw import AdamWConfig, ZeroAdamW
from .muon_plan import SCHEMES, RankPlan, Transfer, rank_plan, receives, sends
from .parallel import ParallelGroups
from .zero import _Param

__all__ = ["DEFAULT_SCHEME", "NS_COEFFICIENTS", "MuonConfig", "ZeroMuon", "newton_schulz"]

#: Keller Jordan's quintic Newton-Schulz coefficients (also ``torch.optim.Muon``'s defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: the exchange scheme used unless configured (chosen by ``benchmarks/bench_muon.py``; see ``docs/trainer.md``).
DEFAULT_SCHEME = "assign"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class MuonConfig:
    """Muon's hyperparameters; ``adamw`` holds the AdamW ones (and the shared weight decay, clipping, buckets)."""

    #: momentum coefficient ``mu`` of the buffer.
    momentum: float = 0.95
    #: Nesterov momentum: orthogonalize ``grad.lerp(momentum, mu)`` instead of the buffer.
    nesterov: bool = True
    #: Newton-Schulz iterations.
    ns_steps: int = 5
    #: the quintic's ``(a, b, c)``.
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS
    #: lower bound of the Frobenius norm the iteration divides by.
    ns_eps: float = 1e-7
    #: dtype of the iteration and of the exchanged matrices: ``bfloat16``, or ``float32`` (tests, precise runs).
    ns_dtype: str = "bfloat16"
    #: the update of a ``rows x cols`` matrix is scaled by ``update_scale * sqrt(max(rows, cols))``.
    update_scale: float = 0.2
    #: where matrices meet: ``assign`` (one rank each, balanced) or ``gather`` (every holder), see muon_plan.
    scheme: str = DEFAULT_SCHEME
    #: the AdamW part: parameters Muon does not step, plus weight decay, clipping and buckets shared by both.
    adamw: AdamWConfig = field(default_factory=AdamWConfig)

    def __post_init__(self) -> None:
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum={self.momentum!r} must lie in [0, 1)")
        if type(self.ns_steps) is not int or not 1 <= self.ns_steps < 100:
            raise ValueError(f"ns_steps={self.ns_steps!r} must be an integer in [1, 100)")
        if len(self.ns_coefficients) != 3 or not all(math.isfinite(c) for c in self.ns_coefficients):
            raise ValueError(f"ns_coefficients={self.ns_coefficients!r} must be three finite numbers")
        if not (self.ns_eps > 0 and math.isfinite(self.ns_eps)):
            raise ValueError(f"ns_eps={self.ns_eps!r} must be positive")
        if self.ns_dtype not in _DTYPES:
            raise ValueError(f"ns_dtype={self.ns_dtype!r} must be one of {', '.join(_DTYPES)}")
        if not (self.update_scale > 0 and math.isfinite(self.update_scale)):
            raise ValueError(f"update_scale={self.update_scale!r} must be positive")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} must be one of {', '.join(SCHEMES)}")

    @property
    def weight_decay(self) -> float:
        return self.adamw.weight_decay


def newton_schulz(
    x: torch.Tensor,
    steps: int = 5,
    coefficients: Sequence[float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on ``x [..., rows, cols]`` (one matrix or a batch), in ``dtype``.

    Approximately ``U V^T`` of each matrix's SVD (singular values land in about [0.7, 1.2], which does not hurt
    training, Keller Jordan's post). A 2-D ``x`` takes exactly ``torch.optim.Muon``'s arithmetic (``addmm``); a
    batch the same with ``baddbmm``.
    """
    a, b, c = coefficients
    X = x.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    # Frobenius norm >= spectral norm: every singular value starts in [0, 1].
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    mm = torch.addmm if X.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = X @ X.mT
        poly = mm(gram, gram, gram, beta=b, alpha=c)
        X = mm(X, poly, X, beta=a)
    return X.mT if tall else X


def _part_view(flat: torch.Tensor, p: _Param) -> torch.Tensor:
    return flat[p.offset : p.offset + p.own].view(p.part_shape)


class ZeroMuon(ZeroAdamW):
    """Muon for the plan's hidden matrices and AdamW for the rest, ZeRO-1 partitioned; see the module docstring.

    ``params``, ``specs`` and ``groups`` as for :class:`~moeckpt.trainer.adamw.ZeroAdamW`. Every rank must build it
    with the same plan (the exchange is derived from it, identically everywhere).
    """

    name = "muon"
    STATE_ROLES: Mapping[str, tuple[str, ...]] = {"adamw": MOMENT_ROLES, "muon": MUON_ROLES}

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        specs: Mapping[str, ParamSpec] | Iterable[ParamSpec],
        groups: ParallelGroups,
        config: MuonConfig | None = None,
        *,
        held: Collection[str] = (),
    ) -> None:
        self.muon = config or MuonConfig()
        self._ns_dtype = _DTYPES[self.muon.ns_dtype]
        # self.config is the AdamW part: its weight decay, clipping and buckets are the shared step settings.
        super().__init__(params, specs, groups, self.muon.adamw, held=held)
        self._build_exchange()

    def _rule_of(self, p: _Param) -> str:
        if p.spec.matrix is None:
            return "adamw"
        if p.tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise LayoutError(f"{p.name}: Muon needs a floating-point parameter, got {p.tensor.dtype}")
        return "muon"

    def describe(self) -> dict:
        return {"name": self.name, "hyperparameters": asdict(self.muon)}

    # ------------------------------------------------------------------------------------------ exchange set-up

    def _build_exchange(self) -> None:
        """Persistent buffers and the copies of every step, from this rank's :class:`RankPlan`."""
        dev, dt = self.groups.device, self._ns_dtype
        muon = [p for p in self._params.values() if p.rule == "muon"]
        specs = [p.spec for p in muon]
        layout, rank = self.groups.layout, self.groups.coords.rank
        plan: RankPlan = rank_plan(specs, layout, rank, self.muon.scheme)
        self.plan = plan
        fams = plan.families
        by_param = {p.name: p for p in muon}
        bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._muon_buckets = [b for b in self._buckets if b.rule == "muon"]
        # What Newton-Schulz reads (the update, cast) and writes back (the orthogonalized update), per bucket.
        self._u = {id(b): torch.zeros(b.total, dtype=dt, device=dev) for b in self._muon_buckets}
        self._o = {id(b): torch.zeros(b.total, dtype=dt, device=dev) for b in self._muon_buckets}
        self._stacks = {
            shape: torch.zeros(len(ms), *shape, dtype=dt, device=dev) for shape, ms in plan.computes.items()
        }
        position = plan.position()

        def part(t: Transfer, buffers: dict[int, torch.Tensor]) -> torch.Tensor:
            """The view of this rank's owned part that transfer ``t``'s box covers, in ``buffers`` (u or o)."""
            p = by_param[fams[t.family].param]
            box = t.box
            for z, sl in p.boxes:
                if z.contains(box):
                    return _part_view(buffers[id(bucket_of[id(p)])], p)[sl][box.relative_to(z).slices()]
            raise LayoutError(f"{p.name}: box {box.to_json()} is in no ZeRO part of rank {rank}; this is a bug")

        def stacked(t: Transfer) -> torch.Tensor:
            """The view of this rank's stacks that transfer ``t``'s box covers."""
            f = fams[t.family]
            first, count = f.matrix_of(t.box)
            shape, i = position[(f.index, first)]
            rows = slice(t.offsets[-2] - f.row0, t.offsets[-2] - f.row0 + t.shape[-2])
            cols = slice(t.offsets[-1], t.offsets[-1] + t.shape[-1])
            view = self._stacks[shape][i : i + count, rows, cols]
            return view if f.batched else view[0]

        world = layout.world
        self._fwd = _Exchange.build(
            plan.forward, rank, world, dt, dev, source=lambda t: part(t, self._u), target=stacked
        )
        self._back = _Exchange.build(
            plan.backward, rank, world, dt, dev, source=stacked, target=lambda t: part(t, self._o)
        )
        self._exchanging = world > 1 and self.groups.world is not None
        # The scaled update per parameter: one add over its segment when all its matrices share a shape.
        self._apply: dict[int, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        scale = self.muon.update_scale
        for b in self._muon_buckets:
            ops = []
            for p in b.params:
                fs = [f for f in fams.values() if f.param == p.name]
                scales = {scale * math.sqrt(max(f.shape)) for f in fs}
                if len(scales) == 1:
                    seg = slice(p.offset, p.offset + p.own)
                    ops.append((b.master[seg], self._o[id(b)][seg], scales.pop()))
                    continue
                for z, sl in p.boxes:  # blocks of different shapes: one add per (ZeRO box, block)
                    for f in fs:
                        s = z.intersect(f.box())
                        if s is not None:
                            rel = s.relative_to(z).slices()
                            ops.append(
                                (
                                    _part_view(b.master, p)[sl][rel],
                                    _part_view(self._o[id(b)], p)[sl][rel],
                                    scale * math.sqrt(max(f.shape)),
                                )
                            )
            self._apply[id(b)] = ops

    # ------------------------------------------------------------------------------------------------- step

    def _update(self, lr: float, grads: Sequence[torch.Tensor]) -> None:
        m = self.muon
        for b, g in zip(self._buckets, grads):
            if b.rule != "muon":
                self._adamw(b, g, lr)
                continue
            buf = b.state["momentum"]
            buf.lerp_(g, 1 - m.momentum)
            self._u[id(b)].copy_(g.lerp_(buf, m.momentum) if m.nesterov else buf)
        self._fwd.run(self.groups.world if self._exchanging else None)
        for stack in self._stacks.values():
            stack.copy_(newton_schulz(stack, m.ns_steps, m.ns_coefficients, m.ns_eps, self._ns_dtype))
        self._back.run(self.groups.world if self._exchanging else None)
        wd = self.config.weight_decay
        for b in self._muon_buckets:
            if b.decay:
                b.master.mul_(1 - lr * wd)
            for master, o, s in self._apply[id(b)]:
                master.add_(o, alpha=-lr * s)

    def comm_bytes(self) -> dict[str, int]:
        out = super().comm_bytes()
        size = torch.empty((), dtype=self._ns_dtype).element_size()
        out["muon_exchange"] = (self._fwd.send.numel() + self._back.send.numel()) * size
        return out


@dataclass
class _Exchange:
    """One all-to-all of the plan: copies into a send buffer (and local copies straight to their target), the
    collective, copies out of the receive buffer. Every view is built once; a step only copies."""

    send: torch.Tensor
    recv: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    pack: list[tuple[torch.Tensor, torch.Tensor]]  # (source view, send-buffer view or local target view)
    unpack: list[tuple[torch.Tensor, torch.Tensor]]  # (receive-buffer view, target view)

    @classmethod
    def build(cls, transfers: list[Transfer], rank: int, world: int, dtype, device, *, source, target) -> _Exchange:
        out, into = sends(transfers, rank), receives(transfers, rank)
        send = torch.zeros(sum(t.numel for t in out), dtype=dtype, device=device)
        recv = torch.zeros(sum(t.numel for t in into), dtype=dtype, device=device)
        send_splits, recv_splits = [0] * world, [0] * world
        pack, unpack = [], []
        offset = 0
        for t in out:
            pack.append((source(t), send[offset : offset + t.numel].view(t.shape)))
            send_splits[t.dst] += t.numel
            offset += t.numel
        for t in transfers:
            if t.src == t.dst == rank:
                pack.append((source(t), target(t)))
        offset = 0
        for t in into:
            unpack.append((recv[offset : offset + t.numel].view(t.shape), target(t)))
            recv_splits[t.src] += t.numel
            offset += t.numel
        return cls(send, recv, send_splits, recv_splits, pack, unpack)

    def run(self, group) -> None:
        for src, dst in self.pack:
            dst.copy_(src)
        if group is not None:
            dist.all_to_all_single(self.recv, self.send, self.recv_splits, self.send_splits, group=group)
        for src, dst in self.unpack:
            dst.copy_(src)
