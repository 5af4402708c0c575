"""Which optimizer a run uses, and whether a checkpoint's optimizer state can continue it.

A checkpoint records the optimizer that wrote its state in ``train_state["optimizer"]`` (``name``, ``steps`` and
``hyperparameters``). Resuming with another optimizer is refused (its moments mean nothing to the other), unless
the run says ``reset_optimizer``: then the weights (parameters and fp32 masters) load and the optimizer starts
fresh. A checkpoint of the same optimizer always loads whole, so an elastic restart under the same command keeps
its state even with ``reset_optimizer`` given.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch

from moeckpt.formats.checkpoint import CheckpointReader, committed_steps
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.index import Index
from moeckpt.formats.roles import MOMENT_ROLES, MUON_ROLES
from moeckpt.reshard.tensors import ParamSpec

from .adamw import AdamWConfig, ZeroAdamW
from .config import OPTIMIZERS  # the one list of --optimizer values: the config validates against it
from .muon import MuonConfig, ZeroMuon
from .parallel import ParallelGroups

__all__ = ["OPTIMIZERS", "OptimizerMismatchError", "build_optimizer", "check_resume_optimizer", "written_by"]

#: the checkpoint roles only one optimizer writes (how a checkpoint without a record is recognised).
_OWN_ROLES = {**dict.fromkeys(MOMENT_ROLES, "adamw"), **dict.fromkeys(MUON_ROLES, "muon")}


class OptimizerMismatchError(MoeckptError, ValueError):
    """A checkpoint's optimizer state was written by another optimizer than the run's."""


def build_optimizer(
    name: str,
    params: Iterable[tuple[str, torch.Tensor]],
    specs: Mapping[str, ParamSpec] | Iterable[ParamSpec],
    groups: ParallelGroups,
    adamw: AdamWConfig,
    *,
    muon: MuonConfig | None = None,
    held: Collection[str] = (),
) -> ZeroAdamW:
    """The ZeRO-1 optimizer ``name`` (``adamw`` or ``muon``); Muon takes ``muon`` with ``adamw`` as its AdamW part.
    ``held``: parameters neither steps (the model's ``untrained()``), saved and restored without optimizer state."""
    if name == "adamw":
        return ZeroAdamW(params, specs, groups, adamw, held=held)
    if name == "muon":
        from dataclasses import replace

        return ZeroMuon(params, specs, groups, replace(muon or MuonConfig(), adamw=adamw), held=held)
    raise ValueError(f"optimizer={name!r} must be one of {', '.join(OPTIMIZERS)}")


def written_by(index: Index) -> str | None:
    """The optimizer whose state ``index`` holds: the recorded name, else the one its state roles belong to (older
    checkpoints, ``moeckpt init --with-optimizer``, ``import-hf``), ``None`` when it holds no optimizer state."""
    recorded = (index.train_state or {}).get("optimizer")
    if isinstance(recorded, dict) and isinstance(recorded.get("name"), str):
        return recorded["name"]
    for entry in index.tensors.values():
        if entry.role in _OWN_ROLES:
            return _OWN_ROLES[entry.role]
    return None


def check_resume_optimizer(location: str, index: Index, optimizer: str, reset: bool) -> bool:
    """Whether the run (optimizer ``optimizer``) loads the optimizer state of the checkpoint at ``location``:
    ``True`` for the same optimizer (or none recorded), ``False`` with ``reset`` for another; raises
    :class:`OptimizerMismatchError` (one line saying how to go on) for another without ``reset``."""
    written = written_by(index)
    if written is None or written == optimizer:
        return True
    if reset:
        return False
    raise OptimizerMismatchError(
        f"{location}: its optimizer state was written by {written}, this run uses {optimizer}; pass "
        f"--optimizer {written} to continue it, or --reset-optimizer to keep the weights and start {optimizer} fresh"
    )


def check_run_optimizer(run_dir: str, init_from: str | None, optimizer: str, reset: bool) -> None:
    """:func:`check_resume_optimizer` on what a run would start from (its newest committed checkpoint, else
    ``init_from``), before any worker starts; nothing to check for a fresh run."""
    steps = committed_steps(run_dir)
    location = steps[-1][1].location if steps else init_from
    if location is None:
        return
    reader = CheckpointReader(location)
    check_resume_optimizer(reader.location, reader.index, optimizer, reset)
