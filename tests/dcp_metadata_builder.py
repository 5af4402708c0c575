"""The ``.metadata`` a many-rank ``dcp.save`` of an MoE training state writes, built without running the ranks.

A real save gathers every rank's plan and write results to rank 0 (each through pickle, which decides which objects
the final pickle shares), merges them with ``create_default_global_save_plan`` and pickles a ``Metadata``. This
builds that same ``Metadata`` from torch's own classes: one chunk per FSDP shard of every parameter and of its
two AdamW moments (``torch.chunk`` semantics over all ranks on dim 0, as FSDP2 shards), a replicated ``step`` per
parameter, the per-parameter ``param_groups`` values torch's flattened optimizer state dict holds, one data-loader
value per rank, and the write results of ``FileSystemWriter`` (one ``__R_0.distcp`` per rank, item offsets and
lengths as a ``torch.save`` of each chunk gives them). Objects are shared where the gathers share them: the
relative path within one rank's results; nothing between a rank's plan and its results.

``python -m tests.dcp_metadata_builder --ranks 1024 --model dsv3`` prints the pickle's size (what
docs/interop.md's cap on ``.metadata`` is measured from).
"""

from __future__ import annotations

import argparse
import math
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: bytes a ``torch.save`` of one chunk adds to its data (zip headers, ``data.pkl``, byteorder, version).
TORCH_SAVE_OVERHEAD = 1152


@dataclass(frozen=True)
class Moe:
    """The parameters of an MoE transformer, by torchtitan's names (the shapes are what matter here)."""

    layers: int
    dense_layers: int
    hidden: int
    vocab: int
    experts: int
    expert_dim: int
    dense_dim: int
    heads: int
    kv_heads: int
    head_dim: int
    q_lora: int = 0
    kv_lora: int = 0
    shared_experts: int = 0

    def params(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        h = self.hidden
        yield "tok_embeddings.weight", (self.vocab, h)
        for i in range(self.layers):
            p = f"layers.{i}."
            if self.q_lora:  # multi-head latent attention (DeepSeek-V3)
                yield p + "attention.wq_a.weight", (self.q_lora, h)
                yield p + "attention.q_norm.weight", (self.q_lora,)
                yield p + "attention.wq_b.weight", (self.heads * self.head_dim, self.q_lora)
                yield p + "attention.wkv_a.weight", (self.kv_lora + 64, h)
                yield p + "attention.kv_norm.weight", (self.kv_lora,)
                yield p + "attention.wkv_b.weight", (self.heads * 256, self.kv_lora)
            else:
                yield p + "attention.wq.weight", (self.heads * self.head_dim, h)
                yield p + "attention.wk.weight", (self.kv_heads * self.head_dim, h)
                yield p + "attention.wv.weight", (self.kv_heads * self.head_dim, h)
                yield p + "attention.q_norm.weight", (self.head_dim,)
                yield p + "attention.k_norm.weight", (self.head_dim,)
            yield p + "attention.wo.weight", (h, self.heads * self.head_dim)
            yield p + "attention_norm.weight", (h,)
            yield p + "ffn_norm.weight", (h,)
            if i < self.dense_layers:
                for w, shape in (("w1", (self.dense_dim, h)), ("w2", (h, self.dense_dim)), ("w3", (self.dense_dim, h))):
                    yield p + f"feed_forward.{w}.weight", shape
                continue
            yield p + "moe.router.gate.weight", (self.experts, h)
            yield p + "moe.expert_bias", (self.experts,)
            yield p + "moe.experts.w1", (self.experts, self.expert_dim, h)
            yield p + "moe.experts.w2", (self.experts, h, self.expert_dim)
            yield p + "moe.experts.w3", (self.experts, self.expert_dim, h)
            if self.shared_experts:
                f = self.shared_experts * self.expert_dim
                for w, shape in (("w1", (f, h)), ("w2", (h, f)), ("w3", (f, h))):
                    yield p + f"moe.shared_experts.{w}.weight", shape
        yield "norm.weight", (h,)
        yield "output.weight", (self.vocab, h)


#: DeepSeek-V3 (671B: 61 layers, the first 3 dense, 256 routed experts and one shared, latent attention).
DSV3 = Moe(
    layers=61,
    dense_layers=3,
    hidden=7168,
    vocab=129280,
    experts=256,
    expert_dim=2048,
    dense_dim=18432,
    heads=128,
    kv_heads=128,
    head_dim=192,
    q_lora=1536,
    kv_lora=512,
    shared_experts=1,
)
#: Qwen3-30B-A3B (48 layers, 128 experts, grouped-query attention with q/k norms).
QWEN3_30B = Moe(
    layers=48,
    dense_layers=0,
    hidden=2048,
    vocab=151936,
    experts=128,
    expert_dim=768,
    dense_dim=0,
    heads=32,
    kv_heads=4,
    head_dim=128,
)
#: Qwen3-235B-A22B (94 layers, 128 experts: the most tensors of the three).
QWEN3_235B = Moe(
    layers=94,
    dense_layers=0,
    hidden=4096,
    vocab=151936,
    experts=128,
    expert_dim=1536,
    dense_dim=0,
    heads=64,
    kv_heads=4,
    head_dim=128,
)
#: a small one, for tests that need a many-rank metadata quickly.
TINY_MOE = Moe(
    layers=2,
    dense_layers=0,
    hidden=64,
    vocab=256,
    experts=4,
    expert_dim=32,
    dense_dim=0,
    heads=4,
    kv_heads=2,
    head_dim=16,
)
MODELS = {"dsv3": DSV3, "qwen3-30b": QWEN3_30B, "qwen3-235b": QWEN3_235B, "tiny": TINY_MOE}

#: what torch's AdamW keeps per parameter group, flattened per parameter by ``get_optimizer_state_dict``.
_PARAM_GROUP_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "foreach",
    "maximize",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
    "initial_lr",
)


def _boxes(shape: tuple[int, ...], ranks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of each non-empty shard of a parameter over ``ranks``: dim 0 in ``torch.chunk`` pieces
    as FSDP2 shards it; where dim 0 has fewer rows than ranks (experts), dim 1 too, as torchtitan shards expert
    weights over more ranks than experts (``Shard(1)``)."""
    if not shape:
        return [((), ())]
    outer = _pieces(shape[0], ranks)
    split = ranks // len(outer) if len(shape) > 1 and len(outer) < ranks else 1
    inner = _pieces(shape[1], split) if split > 1 else [(0, shape[1])] if len(shape) > 1 else [(0, 0)]
    out = []
    for o0, n0 in outer:
        for o1, n1 in inner:
            if len(shape) == 1:
                out.append(((o0,), (n0,)))
            else:
                out.append(((o0, o1) + (0,) * (len(shape) - 2), (n0, n1) + shape[2:]))
    return out


def _pieces(rows: int, parts: int) -> list[tuple[int, int]]:
    """``(offset, rows)`` of each non-empty piece of ``torch.chunk(rows, parts)``."""
    step = math.ceil(rows / parts)
    return [(o, min(step, rows - o)) for o in range(0, rows, step)]


def moe_metadata(model: Moe, ranks: int):
    """The ``torch.distributed.checkpoint.metadata.Metadata`` a ``ranks``-rank save of ``model``'s training state
    (fp32 parameters, AdamW moments and steps, param groups, per-rank data-loader state) holds."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm: dict = {}
    # per rank: [(MetadataIndex fields, length)], turned into that rank's write results at the end
    writes: list[list[tuple[str, tuple[int, ...] | None, int | None, int]]] = [[] for _ in range(ranks)]
    planner: dict = {}

    def tensor(fqn: str, shape: tuple[int, ...], sharded: bool) -> None:
        props = TensorProperties(dtype=torch.float32)
        md = TensorStorageMetadata(properties=props, size=torch.Size(shape), chunks=[])
        sdm[fqn] = md
        planner[fqn] = tuple(fqn.split(".", 1)) if fqn.startswith("optimizer.") else (fqn,)
        boxes = _boxes(shape, ranks) if sharded else [((0,) * len(shape), shape)]
        for rank, (offsets, sizes) in enumerate(boxes):
            md.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            writes[rank].append((fqn, offsets, len(md.chunks) - 1, math.prod(sizes) * 4 + TORCH_SAVE_OVERHEAD))

    def value(fqn: str, rank: int = 0, length: int = 900) -> None:
        sdm[fqn] = BytesStorageMetadata()
        planner[fqn] = tuple(fqn.split("."))
        writes[rank].append((fqn, None, None, length))

    for name, shape in model.params():
        tensor(name, shape, sharded=True)
        for moment in ("exp_avg", "exp_avg_sq"):
            tensor(f"optimizer.state.{name}.{moment}", shape, sharded=True)
        tensor(f"optimizer.state.{name}.step", (), sharded=False)
        for key in _PARAM_GROUP_KEYS:
            value(f"optimizer.param_groups.{name}.{key}", length=1000)
    for rank in range(ranks):
        value(f"dataloader.dp_rank_{rank}", rank=rank, length=2048)
    for key in ("lr_scheduler", "train_state"):
        value(key)

    storage: dict = {}
    for rank, items in enumerate(writes):
        path = f"__{rank}_0.distcp"  # one string per rank's results, as the gather of its results shares it
        pos = 0
        for fqn, offsets, index, length in items:
            key = MetadataIndex(fqn="".join(fqn), offset=None if offsets is None else torch.Size(offsets), index=index)
            storage[key] = _StorageInfo(relative_path=path, offset=pos, length=length)
            pos += length
    return Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id="/checkpoints/step-1000", save_id="0" * 32),
        version="1.0.0",
    )


def moe_metadata_bytes(model: Moe, ranks: int) -> bytes:
    """The ``.metadata`` file's bytes: ``pickle.dumps`` of :func:`moe_metadata`, as ``FileSystemWriter`` writes."""
    return pickle.dumps(moe_metadata(model, ranks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--model", choices=sorted(MODELS), default="dsv3")
    ap.add_argument("--parse", action="store_true", help="also time moeckpt's parse_metadata on it")
    args = ap.parse_args()
    started = time.perf_counter()
    md = moe_metadata(MODELS[args.model], args.ranks)
    chunks = sum(len(t.chunks) for t in md.state_dict_metadata.values() if hasattr(t, "chunks"))
    data = pickle.dumps(md)
    del md
    print(
        f"{args.model} x {args.ranks} ranks: {len(data)} bytes ({len(data) / 2**20:.1f} MiB), {chunks} chunks, "
        f"built in {time.perf_counter() - started:.1f} s"
    )
    if args.parse:
        from moeckpt.formats.dcp import parse_metadata

        started = time.perf_counter()
        parsed = parse_metadata(data, "built")
        print(f"parse_metadata: {len(parsed.tensors)} tensors in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
