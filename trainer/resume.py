"""Automatic resume: find the newest committed checkpoint of a run and load it into a live model and optimizer.

The checkpoint may come from any layout. :func:`restore` asks the load-time resharder
(:func:`moeckpt.reshard.load.load_rank_state`) for exactly the boxes this rank holds in its own layout (the model's
parameters and the ZeRO-1 parts of ``master``, ``exp_avg``, ``exp_avg_sq``), collectively over a gloo group so
replicated tensors are read from storage once, and copies them into the optimizer's live views. With the same
layout and dtype the bytes land exactly where they came from, so training continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError, LayoutError, MoeckptError
from moeckpt.formats.roles import MASTER, PARAM, TRAINING_ROLES, WEIGHT_ROLES
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.load import LoadStats, exchange_pays, load_rank_state

from .optimizer_choice import check_resume_optimizer
from .zero import StatePiece, ZeroOptimizer

__all__ = [
    "DAMAGED_CHECKPOINT_ERRORS",
    "ResumeError",
    "Restored",
    "exchanges",
    "load_pieces",
    "restore",
    "restore_from_state_dict",
]

#: what a damaged checkpoint raises on load (on every rank of a collective load alike): the trainer then falls
#: back to the previous checkpoint. Other errors (another model, a permission problem) stop the run instead.
DAMAGED_CHECKPOINT_ERRORS = (ChecksumMismatchError, DataFileError)


class ResumeError(MoeckptError, ValueError):
    """A run directory whose newest checkpoint cannot continue this run (another model, missing tensors)."""


@dataclass
class Restored:
    """What :func:`restore` loaded."""

    #: the checkpoint it came from.
    location: str
    #: the step the checkpoint was taken at.
    step: int
    #: the checkpoint's train state (step, data position, schedule, optimizer counters, seed).
    train_state: dict[str, Any]
    #: the layout that wrote the checkpoint.
    source_layout: Layout
    #: bytes read and seconds spent on this rank.
    stats: LoadStats
    #: whether the ranks exchanged replicated pieces (else each read its own bytes).
    exchanged: bool = False
    #: the checkpoint's optimizer state was another optimizer's and was not loaded (``reset_optimizer``).
    optimizer_reset: bool = False


def load_pieces(
    reader: CheckpointReader,
    pieces: list[StatePiece],
    layout: Layout,
    rank: int,
    *,
    roles: Iterable[str],
    group=None,
    stats: LoadStats | None = None,
    exchange: bool = True,
    readable=None,
) -> set[str]:
    """Copy the checkpoint's data into ``pieces`` (live views: a rank's boxes in ``layout``); returns the names
    of the checkpoint's logical tensors of ``roles`` (pieces of others are left untouched).

    With ``group`` the read is collective: every rank must pass the same ``roles`` (a rank may hold no box of a
    tensor, e.g. a TP window split that misses it, so the tensor list comes from the index, not from the pieces);
    ``exchange`` and ``readable`` as in :func:`~moeckpt.reshard.load.load_rank_state`.
    """
    keep = set(roles)
    present = sorted(n for n, e in reader.index.tensors.items() if e.role in keep)
    # The pieces themselves are the destinations where they fit (the stored dtype, contiguous): a rank loading
    # alone then reads into them, on a GPU through pinned staging with overlapped copies, without a CPU copy.
    out = {(p.name, p.box): p.tensor for p in pieces}
    devices = {p.tensor.device for p in pieces}
    device = devices.pop() if len(devices) == 1 else None
    state = load_rank_state(
        reader,
        layout,
        rank,
        tensors=present,
        group=group,
        stats=stats,
        exchange=exchange,
        device=device,
        out=out,
        readable=readable,
    )
    by_box = {name: dict(boxes) for name, boxes in state.items()}
    for piece in pieces:
        boxes = by_box.get(piece.name)
        if boxes is None:
            continue
        data = boxes.get(piece.box)
        if data is None:
            raise LayoutError(
                f"{reader.location}: the load returned no box {piece.box.to_json()} of {piece.name} for rank {rank}"
            )
        if data is not piece.tensor:  # else read into it already
            piece.tensor.copy_(data.to(device=piece.tensor.device, dtype=piece.tensor.dtype))
    return set(present)


def exchanges(reads: str, location: str, group) -> bool:
    """Whether ranks loading ``location`` over ``group`` exchange replicated pieces: ``reads`` is ``exchange``,
    ``own`` or ``auto`` (:func:`~moeckpt.reshard.load.exchange_pays`; collective over ``group`` then)."""
    if group is None or reads == "own":
        return False
    return reads == "exchange" or exchange_pays(location, group)


@torch.no_grad()
def restore(
    location: str,
    optimizer: ZeroOptimizer,
    *,
    model_json: dict,
    group=None,
    reads: str = "auto",
    reset_optimizer: bool = False,
    readable=None,
) -> Restored:
    """Load the checkpoint at ``location`` into ``optimizer``'s parameters and state (this rank's boxes).

    ``model_json`` (``ModelSpec.to_json()``) must match the checkpoint's model; ``group`` (a gloo group of the
    whole world, or ``None`` alone) makes the read collective: a failed read raises the same error on every rank.
    ``reads`` says whether the ranks exchange replicated pieces over it (``exchange``), each read their own
    (``own``), or ``auto`` (:func:`~moeckpt.reshard.load.exchange_pays`). Collective over the (expert-)data-parallel
    groups afterwards too (the fp32 masters are gathered into lower-precision parameters). ``readable`` restricts
    which member reads which writer's file (a memory checkpoint held in parts by nodes; implies the exchange).
    """
    exchange = readable is not None or exchanges(reads, location, group)
    reader = CheckpointReader(location)
    index = reader.index
    if index.model and index.model != model_json:
        raise ResumeError(
            f"{location}: the checkpoint holds model {index.model.get('arch')!r} with another config than this run's "
            f"{model_json.get('arch')!r}; pass the run's original --model or use a new --run-dir"
        )
    load_state = check_resume_optimizer(reader.location, index, optimizer.name, reset_optimizer)
    groups = optimizer.groups
    layout, rank = groups.layout, groups.coords.rank
    stats = LoadStats()
    params = optimizer.param_pieces()
    missing = sorted({p.name for p in params} - set(index.tensors))
    if missing:
        raise ResumeError(f"{location}: the checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")
    state_pieces = optimizer.pieces()
    loaded = load_pieces(
        reader,
        params + state_pieces,
        layout,
        rank,
        roles=TRAINING_ROLES if load_state else WEIGHT_ROLES,
        group=group,
        stats=stats,
        exchange=exchange,
        readable=readable,
    )
    masters = {p.name for p in state_pieces if p.role == MASTER}
    if masters and masters <= loaded:
        optimizer.load_params_from_master()
    else:
        # fp32 parameters are their own master; a checkpoint without masters (or of another dtype) starts them
        # from the loaded parameters.
        optimizer.load_master_from_params()
    train_state = dict(index.train_state or {})
    opt_state = train_state.get("optimizer")
    if not load_state:
        optimizer.reset_state()
    elif isinstance(opt_state, dict):
        optimizer.load_state_dict(opt_state)
    return Restored(
        location=reader.location,
        step=int(index.step),
        train_state=train_state,
        source_layout=Layout.from_json(index.layout),
        stats=stats,
        exchanged=exchange,
        optimizer_reset=not load_state,
    )


@torch.no_grad()
def restore_from_state_dict(location: str, optimizer: ZeroOptimizer, spec, *, group=None) -> Restored:
    """Start from a state-dict checkpoint (``moeckpt.save`` of another trainer's model, ``moeckpt.dcp``) whose
    tensors carry ``spec``'s Hugging Face names (:mod:`moeckpt.trainer.interop.bundled`): the parameters, and the
    AdamW moments where the checkpoint has a full set of them, each rank reading its own boxes; the masters are
    taken from the loaded parameters. Collective over ``group`` and the optimizer's groups."""
    from moeckpt.reshard.box_load import load_boxes

    from .interop.bundled import match_model_names

    reader = CheckpointReader(location)
    names = match_model_names(reader.index, spec, reader.location)
    wanted = [(names.tensors[(PARAM, p.param)], p.box, p.tensor) for p in optimizer.param_pieces()]
    wanted += [
        (names.tensors[(p.role, p.param)], p.box, p.tensor)
        for p in optimizer.pieces()
        if (p.role, p.param) in names.tensors
    ]
    stats = LoadStats()
    load_boxes(reader, wanted, group=group, stats=stats)
    optimizer.load_master_from_params()
    return Restored(
        location=reader.location, step=int(reader.index.step), train_state={}, source_layout=Layout(), stats=stats
    )
