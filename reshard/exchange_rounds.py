"""The exchange rounds of a collective load: each member reads the row chunks it owns and sends the others the
parts they need with ``all_to_all_single``, in rounds of bounded size that every member takes part in.

What each member reads, keeps, sends and receives in which round comes from the exchange plan
(:func:`~.rank_exchange.rank_exchange`); :func:`~.load.load_rank_state` plans, opens the chunk cache and agrees on
the outcome, :func:`exchange_rounds` runs the rounds. A member whose read fails keeps taking part, with zeros in
place of what it could not read (:class:`GuardedExtract`), so no member waits for it until the group's timeout.
"""

from __future__ import annotations

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.errors import MoeckptError

from .chunks import ChunkReader


def exchange_rounds(
    chunks, rounds, owner, units, index, mine, state_list, me, size, group, stats, extract: GuardedExtract
) -> None:
    """Run the rounds: read owned chunks (ahead, in the pool), keep local regions, all_to_all the rest."""
    import torch.distributed as dist

    # The send and receive buffers of a round are reused by the next (grown where it needs more): a fresh buffer
    # per round had every byte exchanged land in newly faulted pages.
    send_buf = recv_buf = torch.empty(0, dtype=torch.uint8)
    for keys in rounds:
        for key in keys:
            if owner[key] == me and key[2] and extract.failure is None:
                ref = chunks.ref(key[0], Box(key[1], key[2]))
                per = chunks.chunk_rows(ref)
                c = key[4]
                chunks.read_ahead(ref, c * per, min((c + 1) * per, ref.box.shape[0]))
        # Sizes first (every transfer padded to 8 bytes, so each slot can be viewed as its dtype), then one copy of
        # each region straight into its slot of the send buffer.
        in_sizes, recv_sizes = [0] * size, [0] * size
        sends: list[tuple[int, int, tuple, Box]] = []  # (destination, offset in its part, unit key, sub-region)
        recvs: list[tuple[int, int, int, Box]] = []  # (source, offset in its part, piece position, sub-region)
        for key in keys:
            o = owner[key]
            item_bytes = dtypes.itemsize(index.tensors[key[0]].dtype)
            for g, pos, sub in units[key]:
                if o == g:
                    continue
                nbytes = _padded(sub.numel * item_bytes)
                if o == me:
                    sends.append((g, in_sizes[g], key, sub))
                    in_sizes[g] += nbytes
                elif g == me:
                    recvs.append((o, recv_sizes[o], pos, sub))
                    recv_sizes[o] += nbytes
        in_starts = [sum(in_sizes[:g]) for g in range(size)]
        send_buf, flat_in = _grown(send_buf, sum(in_sizes))
        for g, off, key, sub in sends:
            dtype = dtypes.to_torch(index.tensors[key[0]].dtype)
            start = in_starts[g] + off
            slot = flat_in[start : start + sub.numel * dtypes.itemsize(index.tensors[key[0]].dtype)]
            extract.copy_into(chunks, key[0], Box(key[1], key[2]), sub, slot.view(dtype).view(sub.shape))
        recv_buf, flat_out = _grown(recv_buf, sum(recv_sizes))
        # Every rank takes part in every round (rounds are global), even with nothing to send or receive. The
        # exchange runs in the backend's threads while this rank copies what stays here (and waits less on the
        # slowest rank).
        work = dist.all_to_all_single(flat_out, flat_in, recv_sizes, in_sizes, group=group, async_op=True)
        for key in keys:  # what stays on this rank
            if owner[key] != me:
                continue
            src = Box(key[1], key[2])
            for g, pos, sub in units[key]:
                if g == me:
                    at = state_list[pos][sub.relative_to(mine.pieces[pos].box).slices()]
                    extract.copy_into(chunks, key[0], src, sub, at)
        work.wait()
        stats.rounds += 1
        stats.bytes_received += flat_out.numel()
        out_starts = [sum(recv_sizes[:o]) for o in range(size)]
        for o, off, pos, sub in recvs:
            piece = mine.pieces[pos]
            entry = index.tensors[piece.tensor]
            start = out_starts[o] + off
            raw = flat_out[start : start + sub.numel * dtypes.itemsize(entry.dtype)]
            state_list[pos][sub.relative_to(piece.box).slices()] = raw.view(dtypes.to_torch(entry.dtype)).view(
                sub.shape
            )


def _padded(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _grown(buf: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``buf``, or a larger one where it holds fewer than ``nbytes``, and its first ``nbytes`` bytes."""
    if buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf, buf[:nbytes]


class GuardedExtract:
    """Reads the regions this rank owns; after a read fails it keeps the rank in step with zeros.

    Every rank must take part in every all_to_all round, or the others wait for it until the process group's
    timeout. A damaged piece (checksum mismatch, truncated file) is therefore remembered, the rounds finish with
    zeros in its place, and all ranks then raise the same error together (:func:`~.load._raise_if_any_failed`).
    """

    def __init__(self):
        self.failure: MoeckptError | OSError | None = None

    def copy_into(self, chunks: ChunkReader, tensor: str, src: Box, sub: Box, out: torch.Tensor) -> None:
        """Region ``sub`` of stored piece ``src`` into ``out`` (zeros once a read has failed)."""
        if self.failure is None:
            try:
                chunks.copy_region(tensor, src, sub.relative_to(src), out)
                return
            except (MoeckptError, OSError) as e:
                # Kept without its traceback: the traceback's frames hold this object, and a cycle through them
                # would keep whatever the caller's frames hold (process groups, a whole trainer) alive until the
                # cyclic collector runs, or until interpreter shutdown, where tearing down a process group aborts.
                self.failure = e.with_traceback(None)
        out.zero_()
