"""The memory tier's replicas: a node's files of a memory checkpoint sent to its ``replicas`` buddy nodes
(node ``i`` to nodes ``i+1 .. i+replicas`` mod the nodes, leader to leader over the tier's gloo group), before the
step is committed anywhere (:meth:`~moeckpt.trainer.memory_tier.MemoryTier.save` runs it between the exchange of
what was written and the commit).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moeckpt.formats.checkpoint import staging_storage
from moeckpt.formats.errors import DataFileError
from moeckpt.formats.index import FileEntry

if TYPE_CHECKING:
    from moeckpt.formats.storage import Storage

    from .memory_tier import MemoryStats, MemoryTier

__all__ = ["pack_files", "replicate"]


def replicate(tier: MemoryTier, location: str, by_rank: list[list[FileEntry]], stats: MemoryStats) -> None:
    """Send this node's files to its ``replicas`` buddies, receive the files of the nodes it is buddy of.

    One round per distance ``d``: node ``i``'s leader sends to node ``i+d``'s and receives from ``i-d``'s;
    the other ranks only take part in the agreement. Then every file must be held by ``1 + replicas`` nodes.
    """
    staging = staging_storage(location)
    n = len(tier.nodes)
    for d in range(1, tier.replicas + 1):
        error = None
        if tier.is_leader:
            try:
                dst = tier.leaders[(tier.node_index + d) % n]
                src_node = tier.nodes[(tier.node_index - d) % n]
                src = tier.leaders[(tier.node_index - d) % n]
                mine = [f for r in tier.ranks_of[tier.key] for f in by_rank[r]]
                theirs = [f for r in tier.ranks_of[src_node] for f in by_rank[r]]
                payload = pack_files(staging, mine)
                incoming = torch.empty(sum(f.size for f in theirs), dtype=torch.uint8)
                ops = [
                    dist.P2POp(dist.isend, payload, dst, tier.group),
                    dist.P2POp(dist.irecv, incoming, src, tier.group),
                ]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
                stats.bytes_sent += payload.numel()
                stats.bytes_received += incoming.numel()
                offset = 0
                raw = incoming.numpy()
                for f in theirs:
                    staging.write_parts(f.path, [raw[offset : offset + f.size].data], fsync=False)
                    offset += f.size
            except Exception as e:  # noqa: BLE001 - shared below
                error = f"node {tier.node}: replication at distance {d} failed: {e}"
        tier.agree(error)


def pack_files(staging: Storage, files: list[FileEntry]) -> torch.Tensor:
    """This node's files, end to end in one buffer to send; read one file at a time, so the node holds one
    file's bytes more than the buffer at most."""
    out = torch.empty(sum(f.size for f in files), dtype=torch.uint8)
    offset = 0
    for f in files:
        data = staging.read_bytes(f.path)
        if len(data) != f.size:
            raise DataFileError(f"{staging.path(f.path)}: {len(data)} bytes, {f.size} were written")
        if data:
            out[offset : offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        offset += len(data)
    return out
