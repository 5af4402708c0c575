"""Load-time resharding: a rank's local tensors from a checkpoint written in any layout, reading only what it needs.

Two modes:

* alone (``group=None``): the rank plans its own boxes (:func:`~moeckpt.reshard.planner.plan_load`), opens only the
  source files that hold them and reads only the rows it needs;
* collective (``group`` a ``torch.distributed`` process group, gloo on CPU): every rank plans its own boxes,
  the ranks all_gather compact summaries of the source row chunks they need (:mod:`.rank_exchange`), and each
  derives from them the same split of those chunks into disjoint sets, one reader per chunk with the read
  volume balanced over the ranks, keeping only the chunks it reads or needs; the ranks then exchange what the
  others need with ``all_to_all_single`` in rounds of bounded size. Replicated tensors are then read from
  storage once per group, not once per rank, so storage reads stay about the checkpoint's size at any dp.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from moeckpt.formats import dtypes, errors
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.errors import ChecksumMismatchError, DataFileError, LayoutError, MoeckptError, StorageError
from moeckpt.formats.index import TensorEntry
from moeckpt.formats.pieces import PieceRef
from moeckpt.formats.storage import is_url

from .chunks import ChunkReader
from .collectives import all_gather_json
from .exchange_rounds import GuardedExtract, exchange_rounds
from .fill import fill_boxes, listed_sources, refs_for
from .layout import Layout
from .local import join_local
from .options import LoadOptions
from .placement import is_stored
from .plan import ReshardPlan, SourcePiece
from .planner import plan_load
from .rank_exchange import Summary, decide, gather_summaries, rank_exchange, summarize
from .runtime import paused_gc, single_threaded_torch
from .source_lookup import SourcePositions

RankState = dict[str, list[tuple[Box, torch.Tensor]]]

log = logging.getLogger(__name__)


@dataclass
class LoadStats:
    """What a load did on one rank."""

    #: data bytes this rank fetched from storage (widened to checksum blocks).
    bytes_read: int = 0
    #: bytes of the boxes this rank holds.
    bytes_needed: int = 0
    #: bytes received from other ranks (collective mode).
    bytes_received: int = 0
    #: exchange rounds (collective mode).
    rounds: int = 0
    seconds: float = 0.0


def load_rank_state(
    location: str | CheckpointReader,
    layout: Layout,
    rank: int,
    *,
    roles: Iterable[str] | None = None,
    tensors: Iterable[str] | None = None,
    group=None,
    peers: Sequence[int] | None = None,
    exchange: bool = True,
    stats: LoadStats | None = None,
    options: LoadOptions | None = None,
    readable: Sequence[Collection[int] | None] | None = None,
    device: torch.device | str | None = None,
    out: Mapping[tuple[str, Box], torch.Tensor] | None = None,
) -> RankState:
    """Every box ``rank`` holds in ``layout``, per tensor, in the order its local tensor concatenates them.

    ``roles`` (e.g. ``{"param"}``) or ``tensors`` restrict what is loaded. With ``group`` (a process group whose
    members all call this with their own ``rank``), the read is collective; ``peers`` lists the layout rank of
    each group member in group-rank order (default: group rank ``i`` is layout rank ``i``). With ``group`` and
    ``exchange=False``, each member reads its own bytes as if alone and the members only agree on the outcome
    (a failed read raises the same error class on every member): for members that share one host's page cache,
    where the exchange costs more than the storage reads it saves (see :func:`exchange_pays`).
    ``stats``, if given, is filled with the bytes read and needed; ``options`` tunes chunks, cache and rounds.
    ``readable`` (collective only; a backend storing one file per writer) lists, per group member, the writer
    ranks whose files that member can read (``None``: all), e.g. node-local memory checkpoints that each node
    holds part of: every piece is then read by a member that can read it and exchanged (implies ``exchange``).

    ``device`` (e.g. ``"cuda"``) puts the boxes in that device's memory: a rank loading alone reads them through
    reused pinned buffers with host-to-device copies overlapped with the reads (:mod:`.inplace`); a collective
    load moves them after. ``out`` maps ``(tensor, box)`` to a preallocated destination (the box's shape, the
    stored dtype, contiguous, on ``device`` if given), filled and returned in place of a new tensor; boxes
    without a fitting one get new tensors.
    """
    started = time.perf_counter()
    stats = stats if stats is not None else LoadStats()
    options = options or LoadOptions()
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # "cuda" is the current one: compare as such
    with single_threaded_torch(), paused_gc():  # from the index's parse on: see paused_gc
        reader = location if isinstance(location, CheckpointReader) else CheckpointReader(location)
        index = reader.index
        names = _select(index.tensors, roles, tensors)
        stored = _stored_refs(reader, names)
        sources = None if stored is None else listed_sources(stored.values(), names)
        if group is not None and (exchange or readable is not None):
            state = _load_collective(
                reader, layout, rank, names, group, peers, stats, options, sources, stored, readable=readable
            )
        else:
            failure = None
            try:
                plan = plan_load(index, layout, [rank], tensors=names, sources=sources)
                state = _load_alone(reader, plan, stats, options, stored, device, out)
            except (MoeckptError, OSError) as e:
                if group is None:
                    raise
                failure, state = e.with_traceback(None), {}  # raised below on every member alike
            if group is not None:
                _raise_if_any_failed(failure, group, reader.location)
    if device is not None and group is not None and (exchange or readable is not None):
        state = {n: [(box, t.to(device)) for box, t in boxes] for n, boxes in state.items()}
    stats.bytes_needed = sum(t.numel() * t.element_size() for boxes in state.values() for _, t in boxes)
    stats.seconds = time.perf_counter() - started
    log.debug(
        "rank %d loaded %d bytes from %s (%d read, %d received) in %.2f s",
        rank,
        stats.bytes_needed,
        reader.location,
        stats.bytes_read,
        stats.bytes_received,
        stats.seconds,
    )
    return state


def exchange_pays(location: str, group) -> bool:
    """Whether the members of ``group`` loading from ``location`` should exchange replicated pieces (collective
    read) rather than each read its own: yes unless the checkpoint is on a local path and every member runs on
    this host. Collective over ``group`` (every member must call it).

    On one host the kernel's page cache already serves each stored byte from the device once, however many
    members read it, so exchanging it over the process group only adds copies (measured slower than reading
    alone: docs/benchmarks/README.md). Across hosts, or from an object store (no shared cache), the exchange saves
    the storage reads.
    """
    hosts = all_gather_json(socket.gethostname(), group)
    return is_url(location) or len(set(hosts)) > 1


def local_tensors(
    state: RankState, tensors: dict[str, TensorEntry], layout: Layout, rank: int
) -> dict[str, torch.Tensor]:
    """The local tensor of each loaded tensor: its boxes joined along the TP dim (:func:`~.local.join_local`)."""
    return {name: join_local(tensors[name], layout, rank, dict(boxes)) for name, boxes in state.items()}


def _select(tensors: dict[str, TensorEntry], roles, names) -> list[str]:
    picked = list(tensors) if names is None else list(names)
    if roles is not None:
        keep = set(roles)
        picked = [n for n in picked if n in tensors and tensors[n].role in keep]
    return picked


def _stored_refs(reader: CheckpointReader, names: list[str]) -> dict[tuple[str, Box], PieceRef] | None:
    """The stored pieces to plan from, when they are not the source layout's placements; else None.

    A backend that stores exactly the placements (safetensors) lets the planner derive them from the index alone
    (and a load reads only the headers of the files it needs). Others store pieces of their own: zarr stores grid
    cells, and where the writers' boxes share no coarser regular grid (ZAYA's fused q/k convolution bias at tp 2:
    blocks of 32 and 16) a placement spans several cells, so the load plans from the cells its documents list,
    read once here.
    """
    if reader.backend.stores_placements and not any(is_stored(reader.index.tensors[n]) for n in names):
        return None
    return {(ref.tensor, ref.box): ref for ref in reader.pieces(tensors=set(names))}


def _load_alone(
    reader: CheckpointReader,
    plan: ReshardPlan,
    stats: LoadStats,
    options: LoadOptions,
    stored,
    device: torch.device | None = None,
    out: Mapping[tuple[str, Box], torch.Tensor] | None = None,
) -> RankState:
    (rank_plan,) = plan.ranks
    refs = refs_for(reader, {r.source for p in rank_plan.pieces for r in p.reads}, stored)
    index = reader.index
    pieces = rank_plan.pieces
    dests = [_destination(p, index.tensors[p.tensor].dtype, device, out) for p in pieces]
    # positions whose destination is a new CPU tensor: the assembled tensor itself can take its place
    mine = {pos for pos, d in enumerate(dests) if d.device.type == "cpu" and not _given(out, pieces[pos], d)}
    stats.bytes_read += fill_boxes(reader, refs, pieces, dests, options, threads=options.fill_threads, own=mine)
    state: RankState = {}
    for piece, dest in zip(pieces, dests):
        state.setdefault(piece.tensor, []).append((piece.box, dest))
    return state


def _given(out, piece, dest: torch.Tensor) -> bool:
    return out is not None and out.get((piece.tensor, piece.box)) is dest


def _destination(piece, dtype: str, device: torch.device | None, out) -> torch.Tensor:
    """Where box ``piece`` is loaded: the caller's tensor for it when it fits (its shape, the stored dtype,
    contiguous), else a new one on ``device`` (the CPU by default)."""
    torch_dtype = dtypes.to_torch(dtype)
    given = None if out is None else out.get((piece.tensor, piece.box))
    if (
        given is not None
        and tuple(given.shape) == piece.box.shape
        and given.dtype == torch_dtype
        and given.is_contiguous()
        and (device is None or given.device == device)
    ):
        return given
    return torch.empty(piece.box.shape, dtype=torch_dtype, device=device or "cpu")


def _load_collective(
    reader, layout, rank, names, group, peers, stats, options: LoadOptions, sources, stored, *, readable=None
) -> RankState:
    import torch.distributed as dist

    index = reader.index
    size, me = dist.get_world_size(group), dist.get_rank(group)
    peers = list(range(size)) if peers is None else list(peers)
    if len(peers) != size or peers[me] != rank:
        raise LayoutError(
            f"collective load: group rank {me} of {size} must load layout rank peers[{me}], got rank {rank} and "
            f"peers {peers[:8]}{'...' if len(peers) > 8 else ''}; pass peers= listing each member's layout rank"
        )
    # Each rank plans its own boxes only; what it reads and exchanges follows from the others' summaries.
    positions = SourcePositions(index, sources)
    failure: Exception | None = None
    try:
        plan = plan_load(index, layout, [rank], tensors=names, sources=sources)
        summary = summarize(index, plan.ranks[0], options.chunk_bytes, positions)
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather, then all raise alike
        failure, summary = e, Summary()
    gathered = gather_summaries(summary, failure is not None, group)
    if gathered is None:
        _raise_planning_failure(failure, group)
    decisions = decide(gathered, options.round_bytes, readable=readable, location=reader.location)
    exchange = rank_exchange(index, layout, peers, me, summary, decisions, options.chunk_bytes, positions)
    owner, units, rounds = exchange.owner, exchange.units, exchange.rounds
    order = [key for keys in rounds for key in keys]

    mine = plan.ranks[0]
    state_list = [torch.empty(p.box.shape, dtype=dtypes.to_torch(index.tensors[p.tensor].dtype)) for p in mine.pieces]
    owned_sources = {SourcePiece(k[0], Box(k[1], k[2]), k[3]) for k in order if owner[k] == me}
    extract = GuardedExtract()
    try:
        refs = refs_for(reader, owned_sources, stored)  # reads the headers of the files this rank reads from
    except (MoeckptError, OSError) as e:  # a damaged header: take part in the rounds anyway, then fail
        extract.failure, refs = e.with_traceback(None), {}
    with ChunkReader(
        reader,
        refs,
        chunk_bytes=options.chunk_bytes,
        cache_bytes=options.cache_bytes,
        read_threads=options.read_threads,
        # The rounds copy every region out of its chunk (into a send buffer or this rank's state), never keep a
        # chunk: chunks are mapped where the storage can map, verified over the page cache, not copied in first.
        map_files=True,
    ) as chunks:
        exchange_rounds(chunks, rounds, owner, units, index, mine, state_list, me, size, group, stats, extract)
    failure, extract.failure = extract.failure, None
    _raise_if_any_failed(failure, group, reader.location)
    stats.bytes_read += chunks.bytes_read
    state: RankState = {}
    for piece, t in zip(mine.pieces, state_list):
        state.setdefault(piece.tensor, []).append((piece.box, t))
    return state


def _raise_planning_failure(failure: Exception | None, group) -> NoReturn:
    """Collective, once some rank's planning failed: every rank raises the error of the lowest group rank that
    failed, its class (one of :mod:`moeckpt.formats.errors`) and message, as when every rank planned every rank.
    An error of another kind is re-raised as it is where it happened (a bug to see), the others raise
    :class:`LoadFailedError`."""
    note = None if failure is None else {"type": type(failure).__name__, "message": str(failure)}
    notes = all_gather_json(note, group)
    g, first = next((g, n) for g, n in enumerate(notes) if n is not None)
    if failure is not None and not isinstance(failure, MoeckptError) and note == first:
        raise failure
    cls = _ERROR_CLASSES.get(first["type"])
    if cls is None:
        raise LoadFailedError(f"collective load: group rank {g} could not plan its part: {first['message']}")
    raise cls(first["message"])


class LoadFailedError(MoeckptError, RuntimeError):
    """Another rank of a collective load failed to read its part (its own error names the cause)."""

    exit_code = 1


#: the typed errors, by class name: a rank's failed planning is raised as its class on every rank.
_ERROR_CLASSES = {
    name: cls
    for name, cls in vars(errors).items()
    if isinstance(cls, type) and issubclass(cls, MoeckptError) and cls.__name__ == name
}

#: errors a failed collective read is raised as, on every rank; others become :class:`LoadFailedError`.
_SHARED_ERRORS = {cls.__name__: cls for cls in (ChecksumMismatchError, DataFileError, StorageError)}


def _raise_if_any_failed(failure: BaseException | None, group, location: str) -> None:
    """Collective: if any rank's read failed, every rank raises the same error class (the failing rank with its
    own message, the others naming that rank), so callers can react the same way everywhere (e.g. fall back)."""
    note = None if failure is None else {"type": type(failure).__name__, "message": str(failure)}
    notes = all_gather_json(note, group)
    if failure is not None:
        # A fresh error: re-raising the stored one would tie its traceback to these frames.
        raise _SHARED_ERRORS.get(type(failure).__name__, LoadFailedError)(str(failure))
    for g, other in enumerate(notes):
        if other is not None:
            raise _SHARED_ERRORS.get(other["type"], LoadFailedError)(
                f"{location}: group rank {g} could not read its part: {other['message']}"
            )
