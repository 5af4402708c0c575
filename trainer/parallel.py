"""Process groups of a (tp, ep, dp) layout over an initialized ``torch.distributed`` world, and picking a layout.

Rank numbering is the one documented in :mod:`moeckpt.reshard.layout`: TP innermost
(``rank = dp_rank * tp + tp_rank``) and ``dp_rank = edp_rank * ep + ep_rank``. Four kinds of groups follow:

* **tp**: the ``tp`` consecutive ranks with the same ``dp_rank`` (column/row parallel layers, vocab-parallel
  embedding);
* **dp**: the ``dp`` ranks with the same ``tp_rank`` (gradients of dense parameters, ZeRO-1 of dense state);
* **ep**: the ``ep`` ranks with the same ``tp_rank`` and ``edp_rank`` (token dispatch by all-to-all);
* **edp**: the ``dp / ep`` ranks with the same ``tp_rank`` and ``ep_rank``, which hold replicas of the same experts
  (gradients of expert parameters, ZeRO-1 of expert state).

Everything is backend-agnostic: gloo on CPU, NCCL on NVIDIA and RCCL on AMD GPUs (PyTorch's ROCm build calls RCCL
"nccl" and exposes HIP devices as ``cuda``). Launching is torchrun's job; :func:`init_from_env` reads its variables.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moeckpt.formats.errors import LayoutError, MoeckptError
from moeckpt.reshard.layout import Layout, RankCoords

__all__ = [
    "LaunchError",
    "ParallelGroups",
    "build_groups",
    "choose_layout",
    "default_backend",
    "default_device",
    "group_ranks",
    "init_from_env",
]


class LaunchError(MoeckptError, RuntimeError):
    """The process was started without the environment torchrun provides, or the world does not fit the layout."""


def default_device(local_rank: int = 0) -> torch.device:
    """``cuda:<local_rank>`` when a GPU is visible (NVIDIA or ROCm), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """The collective backend for ``device``: ``nccl`` (RCCL on ROCm) for GPUs, ``gloo`` for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_from_env(*, timeout_s: float = 600.0, backend: str | None = None) -> torch.device:
    """Initialize the default process group from torchrun's variables and return this rank's device.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (the ``env://`` method).
    Does nothing but pick the device when the group already exists. ``timeout_s`` bounds every collective, so a
    dead peer turns into an error instead of a hang.
    """
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = default_device(local_rank)
    if dist.is_initialized():
        return device
    if missing:
        raise LaunchError(
            f"environment variables {', '.join(missing)} are not set: start the trainer with torchrun "
            "(or `moeckpt train --nproc N`), which sets them"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    warning = shared_store_warning(os.environ)
    if warning and os.environ.get("RANK") == "0":
        logging.getLogger(__name__).warning("%s", warning)
    dist.init_process_group(
        backend=backend or default_backend(device),
        init_method="env://",
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return device


def shared_store_warning(env: dict[str, str] | os._Environ) -> str | None:
    """Why a restartable torchrun job may fail to re-form its world, or ``None``.

    torch's c10d rendezvous shares one TCP store with the workers for the agent's life; after a restart the new
    workers find the previous world's keys there and gloo connects to dead ports. ``moeckpt train`` opts out;
    a job started with torchrun by hand may not have.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) < 1:
        return None
    return (
        "torchrun shares its rendezvous store with the workers and this job may restart "
        f"(--max-restarts {env.get('TORCHELASTIC_MAX_RESTARTS')}): a restarted world can read the previous "
        "world's addresses and fail to connect. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun "
        "(moeckpt train --nnodes does)"
    )


def group_ranks(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of each kind as lists of global ranks, in the order :func:`build_groups` creates them."""
    tp, ep, edp = layout.tp, layout.ep, layout.edp
    rank = layout.rank_of
    return {
        "tp": [[rank(tp_rank=t, dp_rank=d) for t in range(tp)] for d in range(layout.dp)],
        "dp": [[rank(tp_rank=t, dp_rank=d) for d in range(layout.dp)] for t in range(tp)],
        "ep": [[rank(tp_rank=t, dp_rank=k * ep + e) for e in range(ep)] for t in range(tp) for k in range(edp)],
        "edp": [[rank(tp_rank=t, dp_rank=k * ep + e) for k in range(edp)] for t in range(tp) for e in range(ep)],
    }


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """This rank's place in a layout and its four process groups.

    Under ``torch.distributed`` every group is a real process group, even one of a single rank (as Megatron does):
    passing ``group=None`` to a collective would silently mean the whole world. Only a single process without
    ``torch.distributed`` (:meth:`single`) has ``None`` groups; test :meth:`size` before a collective there.
    """

    layout: Layout
    coords: RankCoords
    device: torch.device
    tp: Any = None
    dp: Any = None
    ep: Any = None
    edp: Any = None
    #: the whole world, for reductions such as the global gradient norm.
    world: Any = None

    def size(self, kind: str) -> int:
        """Number of ranks in the group ``kind`` (``tp``, ``dp``, ``ep``, ``edp`` or ``world``)."""
        return {
            "tp": self.layout.tp,
            "dp": self.layout.dp,
            "ep": self.layout.ep,
            "edp": self.layout.edp,
            "world": self.layout.world,
        }[kind]

    def rank_in(self, kind: str) -> int:
        """This rank's index inside its group ``kind``."""
        c = self.coords
        return {"tp": c.tp_rank, "dp": c.dp_rank, "ep": c.ep_rank, "edp": c.edp_rank, "world": c.rank}[kind]

    @classmethod
    def single(cls, device: torch.device | None = None) -> ParallelGroups:
        """The groups of a one-process run (layout 1,1,1); needs no ``torch.distributed``."""
        layout = Layout()
        return cls(layout=layout, coords=layout.coords(0), device=device or torch.device("cpu"))


def build_groups(layout: Layout, *, device: torch.device | None = None) -> ParallelGroups:
    """Create the tp, dp, ep and edp groups of ``layout`` over the initialized world; every rank must call it.

    ``torch.distributed.new_group`` is collective over the whole world, so every rank creates every group in the
    same order and keeps the ones it belongs to.
    """
    device = device or default_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if layout.world != 1:
            raise LaunchError(
                f"layout {layout} needs {layout.world} processes but torch.distributed is not initialized; "
                "call init_from_env() under torchrun first"
            )
        return ParallelGroups.single(device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != layout.world:
        raise LaunchError(
            f"layout {layout} needs world size tp*dp = {layout.world}, but {world} processes were started; "
            f"start {layout.world} processes or pick another layout (see choose_layout)"
        )
    mine: dict[str, Any] = {}
    for kind, groups in group_ranks(layout).items():
        for ranks in groups:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return ParallelGroups(
        layout=layout,
        coords=layout.coords(rank),
        device=device,
        world=dist.group.WORLD,
        **mine,
    )


def _accepts(check: Callable[[int, int], Any] | None, tp: int, ep: int) -> str | None:
    """``None`` when ``check`` accepts (tp, ep), else why not. ``check`` may raise LayoutError or return False."""
    if check is None:
        return None
    try:
        ok = check(tp, ep)
    except LayoutError as e:
        return str(e)
    return None if ok is None or ok else f"tp={tp} ep={ep} rejected by the model"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_layout(
    world: int,
    *,
    tp: int | None = None,
    ep: int | None = None,
    max_ep: int | None = None,
    check: Callable[[int, int], Any] | None = None,
) -> Layout:
    """Pick a valid (tp, ep, dp) layout for ``world`` processes.

    Rules, in order:

    1. ``tp`` pinned: it must divide ``world``. Not pinned: ``tp = 1`` (data parallelism first, as ZAYA1 trained;
       tensor parallelism is a choice about memory and links that only the user can make).
    2. ``dp = world / tp``.
    3. ``ep`` pinned: it must divide ``dp``. Not pinned: the largest divisor of ``dp`` that is at most ``max_ep``
       (no bound when ``None``) and that ``check`` accepts (spreading experts widest saves the most memory). Pass
       the old ``ep`` as ``max_ep`` to resume an elastic run on fewer ranks with experts spread as before or less.
    4. ``check(tp, ep)`` (a model's ``check_layout``: raises :class:`LayoutError` or returns ``False`` to refuse)
       must accept the result.

    Raises :class:`LayoutError` naming the world size, the pinned values and the model's reason.
    """
    if type(world) is not int or world < 1:
        raise LayoutError(f"world size must be a positive integer, got {world!r}")
    tp = 1 if tp is None else tp
    if type(tp) is not int or tp < 1 or world % tp:
        raise LayoutError(
            f"tp={tp!r} must be a positive integer dividing the world size {world} "
            "(--nproc, times the nodes of an elastic job)"
        )
    dp = world // tp
    if ep is not None:
        if type(ep) is not int or ep < 1 or dp % ep:
            raise LayoutError(f"ep={ep!r} must be a positive integer dividing dp = world/tp = {world}/{tp} = {dp}")
        why = _accepts(check, tp, ep)
        if why is not None:
            raise LayoutError(f"world {world}: layout tp={tp} ep={ep} dp={dp} is not valid for the model: {why}")
        return Layout(tp=tp, ep=ep, dp=dp)
    reasons = []
    for cand in reversed(_divisors(dp)):
        if max_ep is not None and cand > max_ep:
            continue
        why = _accepts(check, tp, cand)
        if why is None:
            return Layout(tp=tp, ep=cand, dp=dp)
        reasons.append(f"ep={cand}: {why}")
    raise LayoutError(
        f"world {world} with tp={tp}: no expert-parallel degree dividing dp={dp} fits the model "
        f"({'; '.join(reasons) or f'none is at most max_ep={max_ep}'})"
    )
