"""ZeRO-1 geometry and the step every optimizer here shares: state split along dim 0 over the (expert-)data-parallel
group, gradients reduce-scattered to the owners, parameters all-gathered back.

Each rank keeps the full TP/EP-local parameters (what its model computes with) and owns one part of every one of
them: rows ``[part * c, (part + 1) * c)`` of the local tensor's dim 0, ``c = ceil(rows / group)``, where the group
is the data-parallel group for dense parameters and the expert-data-parallel group for expert parameters. That is
exactly :func:`moeckpt.reshard.placement.rank_boxes` for the ZeRO roles (``master`` and every optimizer moment:
:data:`moeckpt.reshard.placement.ZERO_ROLES`), so a checkpoint stores the optimizer's tensors as they are, with no
gather, and a load copies boxes straight back in.

One step (:meth:`ZeroOptimizer.step`):

1. reduce-scatter the gradients over the owning group, so each rank gets the sum of its part, divided by ``dp``.
   Gradient convention: each rank's ``.grad`` is the gradient of the mean loss over *its own* micro-batch; dense
   gradients are summed over the ``dp`` ranks, expert gradients over the ``dp / ep`` replicas only (the backward
   of the expert all-to-all already summed the ``ep`` ranks' tokens); both divided by ``dp`` give the gradient of
   the global mean loss. Parameters replicated over TP ranks must already have identical gradients there (as with
   Megatron-style TP without sequence parallelism).
2. clip by the global gradient norm: every distinct element counted once (TP-replicated parts only on
   ``tp_rank == 0``), summed over the world;
3. the update rule of the subclass (:meth:`ZeroOptimizer._update`) on the owned parts, in fp32 (with an fp32
   master copy when parameters are bf16/fp16). A parameter whose ``.grad`` is ``None`` counts as a zero gradient
   (ranks must agree on the collective), where torch would skip it;
4. all-gather the updated parts back into the full local parameters.

Parameters of one group, dtype, decay and update rule share flat buckets, so a step is a few collectives and a
few vectorized ops per bucket, not per parameter. A bucket's state tensors are named by their checkpoint role.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from moeckpt.formats.box import Box
from moeckpt.formats.errors import LayoutError
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.roles import MASTER, PARAM
from moeckpt.reshard.local import joined_shape, slices_in_local
from moeckpt.reshard.placement import model_parallel_boxes, rank_boxes
from moeckpt.reshard.tensors import ParamSpec, tensor_name

from .parallel import ParallelGroups

__all__ = ["StatePiece", "ZeroOptimizer"]

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class StatePiece:
    """One box of one optimizer tensor held by this rank, as a live view: save reads it, load copies into it."""

    #: the model parameter.
    param: str
    #: ``master``, ``exp_avg``, ``exp_avg_sq``, ``momentum`` (``param`` for :meth:`ZeroOptimizer.param_pieces`).
    role: str
    #: the box of the global tensor, as ``rank_boxes`` gives it.
    box: Box
    #: a view with ``box.shape`` of the optimizer's fp32 storage (or of the local parameter).
    tensor: torch.Tensor

    @property
    def name(self) -> str:
        """The logical tensor name in a checkpoint (``exp_avg/<param>``, ...)."""
        return tensor_name(self.param, self.role)


@dataclass(eq=False)
class _Param:
    """One parameter's geometry: local tensor, owned rows, and where its part sits in its bucket."""

    name: str
    tensor: torch.Tensor
    spec: ParamSpec
    entry: TensorEntry  # role "master": rank_boxes of it are the ZeRO boxes
    kind: str  # "dp" or "edp"
    parts: int
    part: int
    rowsize: int
    seg: int  # padded part length (elements), equal on every rank of the group
    own: int  # elements this rank owns (<= seg)
    lo: int  # first owned row
    part_shape: tuple[int, ...]
    boxes: list[tuple[Box, tuple[slice, ...]]] = field(default_factory=list)  # box, slice of the owned part
    param_boxes: list[tuple[Box, tuple[slice, ...]]] = field(default_factory=list)  # box, slice of the local tensor
    offset: int = 0  # start of this parameter's segment in its bucket
    rule: str = ""  # the update rule (bucket treatment) that steps it


@dataclass(eq=False)
class _Bucket:
    kind: str
    dtype: torch.dtype
    decay: bool
    counted: bool  # contributes to the global norm on this rank
    rule: str  # the update rule, e.g. "adamw" or "muon"
    params: list[_Param]
    total: int = 0
    #: fp32 [total] (a copy, or for fp32 parameters the owned values); allocated with the bucket.
    master: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    #: the rule's fp32 [total] state tensors, by checkpoint role (``exp_avg``, ``momentum``, ...).
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def _local_layout(spec: ParamSpec, groups: ParallelGroups) -> tuple[TensorEntry, list[Box], int | None]:
    entry = TensorEntry(
        name=tensor_name(spec.name, MASTER),
        shape=tuple(spec.shape),
        dtype="float32",
        role=MASTER,
        param=spec.name,
        sharding=spec.rule.to_json(),
    )
    c = groups.coords
    mp = model_parallel_boxes(entry, groups.layout, c.tp_rank, c.ep_rank)
    return entry, mp, spec.rule.concat_dim


class ZeroOptimizer:
    """The ZeRO-1 skeleton: geometry, buckets, gradient reduction, clipping, parameter gathering and the state as
    checkpoint pieces. Subclasses name their update rules (:meth:`_rule_of`, :attr:`STATE_ROLES`) and implement
    :meth:`_update`.

    ``params`` are the module's ``(name, tensor)`` pairs (``named_parameters()``), each TP/EP-local as the plan's
    rule cuts it; ``specs`` the plan (:class:`ParamSpec` by name, global shapes and rules). ``config`` must have
    ``weight_decay``, ``decay_vectors``, ``max_grad_norm``, ``skip_nonfinite`` and ``bucket_mib``
    (:class:`~moeckpt.trainer.adamw.AdamWConfig`). Call :meth:`step` after ``backward()`` with the learning rate
    of the step, then :meth:`zero_grad`.

    ``held`` names parameters no rule steps (DeepSeek-V3's routing correction bias, ``ModelSpec.untrained()``):
    they have no optimizer state and join no bucket or collective, but their boxes are in :meth:`param_pieces`,
    so checkpoints save and restore them like any weight.
    """

    #: the optimizer's name, recorded in a checkpoint's train state.
    name = ""
    #: the state roles (fp32 tensors of the bucket's length) of each update rule, in checkpoint order.
    STATE_ROLES: Mapping[str, tuple[str, ...]] = {}

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        specs: Mapping[str, ParamSpec] | Iterable[ParamSpec],
        groups: ParallelGroups,
        config,
        *,
        held: Collection[str] = (),
    ) -> None:
        self.groups = groups
        self.config = config
        self.steps = 0
        spec_map: dict[str, ParamSpec] = {}
        if isinstance(specs, Mapping):
            spec_map.update(specs)
        else:
            spec_map.update((s.name, s) for s in specs)
        self._params: dict[str, _Param] = {}
        #: parameters no update rule steps (``held``): geometry only, for :meth:`param_pieces`.
        self._held: dict[str, _Param] = {}
        for name, tensor in params:
            spec = spec_map.get(name)
            if spec is None:
                raise LayoutError(f"parameter {name!r} is not in the model's sharding plan; add it to param_specs")
            (self._held if name in held else self._params)[name] = self._describe(name, tensor, spec, groups)
        for p in self._params.values():
            p.rule = self._rule_of(p)
        self._buckets = self._make_buckets()
        self.load_master_from_params()

    def _rule_of(self, p: _Param) -> str:
        """The update rule that steps parameter ``p`` (a key of :attr:`STATE_ROLES`)."""
        raise NotImplementedError

    def _update(self, lr: float, grads: Sequence[torch.Tensor]) -> None:
        """Update every bucket's ``master`` from its reduced, clipped gradient ``grads[i]`` (fp32, owned part)."""
        raise NotImplementedError

    @property
    def num_buckets(self) -> int:
        """How many flat buckets a step communicates (one reduce-scatter and one all-gather each)."""
        return len(self._buckets)

    # ----------------------------------------------------------------------------------------------- geometry

    @staticmethod
    def _describe(name: str, tensor: torch.Tensor, spec: ParamSpec, groups: ParallelGroups) -> _Param:
        entry, mp, concat = _local_layout(spec, groups)
        want = joined_shape(mp, concat)
        if tuple(tensor.shape) != want:
            raise LayoutError(
                f"parameter {name!r}: local shape {list(tensor.shape)} does not match {list(want)}, what its rule "
                f"{spec.rule.to_json()} gives for global shape {list(spec.shape)} in layout {groups.layout}"
            )
        if not tensor.is_contiguous():
            raise LayoutError(f"parameter {name!r} is not contiguous; ZeRO-1 views its rows as flat ranges")
        kind = "edp" if spec.rule.expert_dim is not None else "dp"
        parts, part = groups.size(kind), groups.rank_in(kind)
        # A scalar is one row of one element, so part 0 owns it (as zero_part says).
        rows = tensor.shape[0] if tensor.dim() else 1
        rowsize = math.prod(tensor.shape[1:]) if tensor.dim() else 1
        chunk = -(-rows // parts)
        lo, hi = min(part * chunk, rows), min((part + 1) * chunk, rows)
        part_shape = (hi - lo, *tensor.shape[1:]) if tensor.dim() else (() if hi > lo else (0,))
        p = _Param(
            name=name,
            tensor=tensor,
            spec=spec,
            entry=entry,
            kind=kind,
            parts=parts,
            part=part,
            rowsize=rowsize,
            seg=chunk * rowsize,
            own=(hi - lo) * rowsize,
            lo=lo,
            part_shape=part_shape,
        )
        rank = groups.coords.rank
        p.boxes = [(z, slices_in_local(z, mp, concat, lo)) for z in rank_boxes(entry, groups.layout, rank)]
        param_entry = TensorEntry(
            name=spec.name, shape=entry.shape, dtype="float32", role=PARAM, param=spec.name, sharding=entry.sharding
        )
        p.param_boxes = [(b, slices_in_local(b, mp, concat)) for b in rank_boxes(param_entry, groups.layout, rank)]
        return p

    def _make_buckets(self) -> list[_Bucket]:
        cfg, tp_rank = self.config, self.groups.coords.tp_rank
        by_key: dict[tuple, list[_Param]] = {}
        for p in self._params.values():
            decay = cfg.weight_decay > 0 and (cfg.decay_vectors or p.tensor.dim() >= 2)
            rule = p.entry.sharding
            counted = "tp" in rule or tp_rank == 0
            by_key.setdefault((p.kind, p.tensor.dtype, decay, counted, p.rule), []).append(p)
        limit = int(cfg.bucket_mib * 2**20) // 4  # fp32 elements over the whole group
        buckets = []
        for (kind, dtype, decay, counted, rule_name), plist in by_key.items():
            current: list[_Param] = []
            size = 0
            for p in plist:
                if current and (size + p.seg) * p.parts > limit:
                    buckets.append(_Bucket(kind, dtype, decay, counted, rule_name, current))
                    current, size = [], 0
                current.append(p)
                size += p.seg
            if current:
                buckets.append(_Bucket(kind, dtype, decay, counted, rule_name, current))
        dev = self.groups.device
        for b in buckets:
            offset = 0
            for p in b.params:
                p.offset = offset
                offset += p.seg
            b.total = offset
            b.state = {role: torch.zeros(b.total, dtype=torch.float32, device=dev) for role in self.STATE_ROLES[b.rule]}
            b.master = torch.zeros(b.total, dtype=torch.float32, device=dev)
        return buckets

    def _own_flat(self, p: _Param) -> torch.Tensor:
        """The owned rows of the local parameter, flat (a view)."""
        return p.tensor.detach().view(-1)[p.lo * p.rowsize : p.lo * p.rowsize + p.own]

    # ------------------------------------------------------------------------------------------------- step

    def _group(self, kind: str):
        return getattr(self.groups, kind)

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """One step at learning rate ``lr``; returns the global gradient norm before clipping.

        With ``skip_nonfinite`` a NaN/inf norm leaves parameters and state untouched (the step count too), and the
        norm is returned so the trainer can report it.
        """
        cfg = self.config
        grads = [self._reduce_grads(b) for b in self._buckets]
        sq = torch.zeros((), dtype=torch.float64, device=self.groups.device)
        for b, g in zip(self._buckets, grads):
            if b.counted:
                sq += g.double().square().sum()
        if self.groups.size("world") > 1:
            dist.all_reduce(sq, group=self.groups.world)
        norm = float(sq.sqrt())
        if cfg.skip_nonfinite and not math.isfinite(norm):
            return norm
        if cfg.max_grad_norm:
            # The same clamped factor torch.nn.utils.clip_grad_norm_ applies (multiplying by 1.0 is exact).
            coef = torch.clamp(torch.tensor(cfg.max_grad_norm / (norm + 1e-6), dtype=torch.float32), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.device))
        self.steps += 1
        self._update(lr, grads)
        for b in self._buckets:
            self._gather_params(b)
        return norm

    def _reduce_grads(self, b: _Bucket) -> torch.Tensor:
        """This rank's owned gradient elements of bucket ``b``, summed over the group and divided by dp (fp32)."""
        parts = b.params[0].parts
        dev = self.groups.device
        if parts == 1:
            flat = torch.zeros(b.total, dtype=torch.float32, device=dev)
            for p in b.params:
                if p.tensor.grad is not None:
                    flat[p.offset : p.offset + p.own].copy_(p.tensor.grad.view(-1))
        else:
            # Row r of the bucket holds what rank r of the group owns, so a reduce-scatter hands each rank its part.
            full = torch.zeros(parts, b.total, dtype=torch.float32, device=dev)
            for p in b.params:
                if p.tensor.grad is None:
                    continue
                g = p.tensor.grad.detach().reshape(-1)
                padded = torch.zeros(parts * p.seg, dtype=torch.float32, device=dev)
                padded[: g.numel()].copy_(g)
                full[:, p.offset : p.offset + p.seg].copy_(padded.view(parts, p.seg))
            flat = torch.empty(b.total, dtype=torch.float32, device=dev)
            _reduce_scatter(flat, full.view(-1), group=self._group(b.kind))
        dp = self.groups.layout.dp
        if dp > 1:
            flat.div_(dp)
        return flat

    def _gather_params(self, b: _Bucket) -> None:
        parts = b.params[0].parts
        if parts == 1:
            for p in b.params:
                self._own_flat(p).copy_(b.master[p.offset : p.offset + p.own])
            return
        mine = b.master.to(b.dtype)
        full = torch.empty(parts, b.total, dtype=b.dtype, device=mine.device)
        _all_gather(full.view(-1), mine, group=self._group(b.kind))
        for p in b.params:
            n = p.tensor.numel()
            p.tensor.detach().view(-1).copy_(full[:, p.offset : p.offset + p.seg].reshape(-1)[:n])

    def zero_grad(self) -> None:
        """Drop every parameter's gradient."""
        for p in self._params.values():
            p.tensor.grad = None

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sends in one step, by collective, as bandwidth-optimal (ring) algorithms move them: a
        reduce-scatter or all-gather over a group of ``n`` sends ``(n - 1) / n`` of the buffer. For benchmarks."""
        out = {"reduce_scatter": 0, "all_gather": 0, "grad_norm": 8 if self.groups.size("world") > 1 else 0}
        for b in self._buckets:
            n = b.params[0].parts
            if n > 1:
                out["reduce_scatter"] += (n - 1) * b.total * 4
                out["all_gather"] += (n - 1) * b.total * torch.empty((), dtype=b.dtype).element_size()
        return out

    # -------------------------------------------------------------------------------------------- state

    @torch.no_grad()
    def load_master_from_params(self) -> None:
        """Set every fp32 master from the current parameters: after loading a checkpoint that has no masters."""
        for b in self._buckets:
            self._master_from(b)

    def _master_from(self, b: _Bucket) -> None:
        b.master.zero_()
        for p in b.params:
            b.master[p.offset : p.offset + p.own].copy_(self._own_flat(p))

    @torch.no_grad()
    def load_params_from_master(self) -> None:
        """After loading a checkpoint with masters: all-gather them, cast, into the (non-fp32) parameters.

        fp32 parameters have no stored master (the parameter is its own master), so their internal copy is
        refreshed from the loaded parameters instead. Collective over the (expert-)data-parallel groups.
        """
        for b in self._buckets:
            if b.dtype == torch.float32:
                self._master_from(b)
            else:
                self._gather_params(b)

    @torch.no_grad()
    def reset_state(self) -> None:
        """Zero every moment and the step count (the masters stay): a fresh optimizer on the current weights."""
        for b in self._buckets:
            for t in b.state.values():
                t.zero_()
        self.steps = 0

    def roles(self, name: str) -> tuple[str, ...]:
        """The optimizer roles stored for parameter ``name``: ``master`` only when it is not fp32, then the state
        roles of its update rule."""
        if name in self._held:
            return ()
        p = self._params[name]
        extra = (MASTER,) if p.tensor.dtype != torch.float32 else ()
        return extra + self.STATE_ROLES[p.rule]

    def rule_of(self, name: str) -> str:
        """The update rule that steps parameter ``name`` (``adamw``, ``muon``; ``held`` for a held one)."""
        return "held" if name in self._held else self._params[name].rule

    def pieces(self) -> list[StatePiece]:
        """Every box of ``master`` (non-fp32 parameters) and of the state roles this rank holds.

        Boxes are exactly ``rank_boxes(entry, layout, rank)`` of those logical tensors, in :meth:`roles` order; the
        tensors are live fp32 views, so a loader fills the optimizer by copying into them, then calls
        :meth:`load_params_from_master` (when masters were loaded) to refresh the parameters.
        """
        out: list[StatePiece] = []
        for b in self._buckets:
            for p in b.params:
                for role in self.roles(p.name):
                    flat = (b.master if role == MASTER else b.state[role])[p.offset : p.offset + p.own]
                    part = flat.view(p.part_shape)
                    out.extend(StatePiece(p.name, role, box, part[sl]) for box, sl in p.boxes)
        return out

    def param_pieces(self) -> list[StatePiece]:
        """Every box of every parameter this rank holds (``rank_boxes`` of role ``param``), as views of the local
        parameters: what a checkpoint saves from, and loads into, for the model's weights."""
        out: list[StatePiece] = []
        for p in (*self._params.values(), *self._held.values()):
            local = p.tensor.detach()
            out.extend(StatePiece(p.name, PARAM, box, local[sl]) for box, sl in p.param_boxes)
        return out

    def piece_map(self) -> dict[str, list[StatePiece]]:
        """:meth:`pieces` grouped by logical tensor name (``exp_avg/<param>``, ...)."""
        out: dict[str, list[StatePiece]] = {}
        for piece in self.pieces():
            out.setdefault(piece.name, []).append(piece)
        return out

    def state_dict(self) -> dict:
        """The optimizer's scalar state as plain JSON (tensors travel as :meth:`pieces`)."""
        return {"steps": self.steps}

    def load_state_dict(self, state: Mapping) -> None:
        steps = state.get("steps")
        if type(steps) is not int or steps < 0:
            raise ValueError(f"optimizer state: 'steps' must be a non-negative integer, got {steps!r}")
        self.steps = steps

    def describe(self) -> dict:
        """Which optimizer this is and its hyperparameters, as JSON: what a checkpoint records as having written
        its optimizer state (``train_state["optimizer"]``, next to :meth:`state_dict`)."""
        return {"name": self.name, "hyperparameters": asdict(self.config)}
