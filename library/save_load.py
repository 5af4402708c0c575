"""The library API behind ``import moeckpt``: ``save``, ``async_save`` and ``load`` of any trainer's state dict.

They follow ``torch.distributed.checkpoint``'s conventions: collective calls, every rank passing its own state
dict (DTensors on any mesh, plain tensors, JSON values), ``process_group`` the group of the saving ranks (default:
the whole world, or a single process without ``torch.distributed``). What differs is what lands on disk: a
moeckpt checkpoint (checksummed, JSON index, no pickle, safetensors or zarr, local disk or any fsspec URL) that
loads into any other mesh, world size or bundled-trainer layout.

The ranks coordinate over gloo even when training runs on NCCL: a group of the same ranks with the gloo backend is
made once per process group (collective the first time) and reused. ``async_save`` coordinates over a second
one, so a save persisting in the background never interleaves its messages with a ``save`` or ``load`` of the
caller's thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.backend import get_backend
from moeckpt.formats.box import Box
from moeckpt.formats.compression import NONE
from moeckpt.formats.errors import MoeckptError
from moeckpt.formats.pieces import Piece
from moeckpt.reshard import collectives
from moeckpt.reshard.load import LoadStats
from moeckpt.reshard.save_protocol import SaveFailedError, save_collective

from .state_load import load_state_dict
from .state_save import SavePlan, plan_state_save, rank_pieces

__all__ = ["AsyncSave", "SaveStats", "async_save", "load", "save"]

log = logging.getLogger(__name__)

_GROUPS: dict[tuple[Any, str], Any] = {}


def coordination_group(process_group=None, purpose: str = "sync"):
    """A gloo group over the ranks of ``process_group`` for JSON coordination (``None`` without distributed).

    The default group is used as it is when it is gloo and ``purpose`` is ``sync``; otherwise a group is made once
    per (process group, purpose) and cached (making it is collective over the group's ranks).
    """
    if not collectives.is_distributed():
        return None
    import torch.distributed as dist

    base = process_group if process_group is not None else dist.group.WORLD
    key = (base, purpose)
    found = _GROUPS.get(key)
    if found is not None:
        return found
    if purpose == "sync" and dist.get_backend(base) == "gloo":
        found = process_group
    else:
        ranks = dist.get_process_group_ranks(base)
        found = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    _GROUPS[key] = found
    return found


@dataclass
class SaveStats:
    """What one save did on this rank."""

    #: seconds the caller was blocked (the snapshot for ``async_save``, the whole save for ``save``).
    blocked_s: float = 0.0
    #: seconds from the start of the persist to the commit.
    persist_s: float = 0.0
    #: bytes this rank wrote.
    bytes_written: int = 0


class Snapshot:
    """Reused host buffers (pinned when the tensors live on a GPU) for the boxes one rank writes.

    A save copies each box it writes into its buffer and persists from there, so training can change the tensors
    as soon as the copy is done. The buffers of a key and box are kept for the next save of the same state, so only
    the first save allocates (and pins) them.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Box, torch.dtype], torch.Tensor] = {}

    def take(self, views: list[tuple[str, Box, torch.Tensor]]) -> list[Piece]:
        pieces = []
        on_device = False
        kept = {}
        for key, box, view in views:
            view = view.detach()
            k = (key, box, view.dtype)
            buf = self._buffers.get(k)
            if buf is None:
                pin = view.device.type != "cpu" and torch.cuda.is_available()
                buf = torch.empty(box.shape, dtype=view.dtype, pin_memory=pin)
            kept[k] = buf
            buf.copy_(view, non_blocking=True)
            on_device = on_device or view.device.type != "cpu"
            pieces.append(Piece(key, box, buf))
        if on_device:
            torch.cuda.synchronize()
        self._buffers = kept  # buffers of keys no longer saved are released
        return pieces


def _pieces_now(views: list[tuple[str, Box, torch.Tensor]]) -> list[Piece]:
    """Pieces straight from the views (a synchronous save writes them before returning): CPU views as they are,
    device views copied to the host."""
    out = []
    for key, box, view in views:
        view = view.detach()
        out.append(Piece(key, box, view if view.device.type == "cpu" else view.cpu()))
    return out


def save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group=None,
    format: str = "safetensors",
    overwrite: bool = False,
    step: int = 0,
    model: dict[str, Any] | None = None,
    compress: str = NONE,
) -> SaveStats:
    """Save every rank's ``state_dict`` as one checkpoint at ``path``; collective over ``process_group``.

    Returns after the checkpoint is committed (atomically: nothing is visible at ``path`` before). ``step`` and
    ``model`` (``{"arch": ..., "config": {...}}`` of a bundled architecture) go into the index. ``compress``:
    lossless compression of the data (``"blosc-zstd"``, ``format="zarr"`` only; ``"none"`` stores it raw).
    """
    t0 = time.perf_counter()
    path = os.fspath(path)
    get_backend(format, compress=compress)  # refused on every rank before anything collective
    group = coordination_group(process_group)
    plan = plan_state_save(state_dict, group=group, backend=format, step=step, model=model, compress=compress)
    pieces = _pieces_now(rank_pieces(plan))
    save_collective(path, plan.index, pieces, plan.boxes, group=group, overwrite=overwrite)
    stats = SaveStats(bytes_written=_nbytes(pieces))
    stats.blocked_s = stats.persist_s = time.perf_counter() - t0
    return stats


@dataclass
class AsyncSave:
    """A save persisting in the background: :meth:`wait` for its commit (raises if it failed), :meth:`done`."""

    path: str
    stats: SaveStats
    _thread: threading.Thread | None = None
    _errors: list[BaseException] = field(default_factory=list)

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> SaveStats:
        """Block until the save is committed; raise :class:`~moeckpt.reshard.save_protocol.SaveFailedError` if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._errors:
            e = self._errors[0]
            if isinstance(e, MoeckptError):
                raise e
            raise SaveFailedError(f"{self.path}: the background save failed: {type(e).__name__}: {e}") from e
        return self.stats


_INFLIGHT: dict[Any, AsyncSave] = {}
_SNAPSHOTS: dict[Any, Snapshot] = {}


def async_save(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group=None,
    format: str = "safetensors",
    overwrite: bool = False,
    step: int = 0,
    model: dict[str, Any] | None = None,
    compress: str = NONE,
) -> AsyncSave:
    """Like :func:`save`, but return once the state is copied into reused host buffers; the rest happens in a
    background thread. A previous ``async_save`` over the same group is waited for first (one in flight)."""
    path = os.fspath(path)
    get_backend(format, compress=compress)
    key = process_group
    previous = _INFLIGHT.pop(key, None)
    if previous is not None:
        previous.wait()
    t0 = time.perf_counter()
    group = coordination_group(process_group, "async")
    plan: SavePlan = plan_state_save(state_dict, group=group, backend=format, step=step, model=model, compress=compress)
    snapshot = _SNAPSHOTS.setdefault(key, Snapshot())
    pieces = snapshot.take(rank_pieces(plan))
    stats = SaveStats(bytes_written=_nbytes(pieces))
    stats.blocked_s = time.perf_counter() - t0
    handle = AsyncSave(path, stats)

    def persist() -> None:
        t1 = time.perf_counter()
        try:
            save_collective(path, plan.index, pieces, plan.boxes, group=group, overwrite=overwrite)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            handle._errors.append(e)
            log.warning("background save to %s failed: %s", path, e)
        stats.persist_s = time.perf_counter() - t1

    handle._thread = threading.Thread(target=persist, name="moeckpt-async-save", daemon=True)
    handle._thread.start()
    _INFLIGHT[key] = handle
    return handle


def load(
    state_dict: MutableMapping[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group=None,
    stats: LoadStats | None = None,
) -> dict[str, Any]:
    """Fill ``state_dict``'s tensors in place from the checkpoint at ``path`` (any mesh or layout wrote it), put
    its JSON values back into ``state_dict``, and return the checkpoint's JSON values; collective."""
    return load_state_dict(state_dict, os.fspath(path), group=coordination_group(process_group), stats=stats)


def _nbytes(pieces: list[Piece]) -> int:
    return sum(p.box.numel * dtypes.itemsize(dtypes.from_torch(p.data.dtype)) for p in pieces)
