"""Export a moeckpt checkpoint (any layout, any storage) as a standard torch DCP checkpoint, written by torch's own
``dcp.save`` from one process.

``--mapping torchtitan`` writes a ``qwen3_moe``, ``deepseek_v3`` or ``gpt_oss`` checkpoint under torchtitan's names
(what ``dcp.load`` into a torchtitan Qwen3-MoE, DeepSeek-V3 or gpt-oss model and its flattened optimizer reads; the
names and layouts of each family are its module's in :mod:`.torchtitan`): the model at the top level, AdamW moments as
``optimizer.state.<fqn>.exp_avg`` / ``exp_avg_sq`` with ``.step``, ``train_state.step``, and the non-tensor values
an import from torchtitan kept (``param_groups``, ``lr_scheduler``, ``dataloader``). ``--mapping none`` writes every
logical tensor under its own name. ``--mapping megatron`` writes a ``qwen3_moe``, ``mixtral`` or ``deepseek_v3``
checkpoint as Megatron-Core's ``dist_checkpointing`` checkpoint of its GPTModel (:mod:`.megatron_export`: its
sharded keys, the modules' empty ``_extra_state`` objects, ``metadata.json`` and a pickle-free ``common.pt``), and
with ``--megatron-optimizer`` AdamW's state for Megatron's optimizer (:mod:`.megatron_optimizer`).

Memory stays one tensor: the state dict handed to ``dcp.save`` holds meta tensors (shape and dtype only), and the
save planner reads each tensor from the checkpoint when DCP asks for its data, then drops it.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moeckpt.formats import dtypes
from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp.plain_pickle import torch_file
from moeckpt.formats.errors import DestinationNotEmptyError
from moeckpt.formats.storages import open_storage

from ..models import ModelSpec
from . import torchtitan
from .common import MappingError
from .megatron_optimizer import MegatronOptimizerConfig
from .unmapped import VALUES_KEY

EXPORT_MAPPINGS = ("torchtitan", "megatron", "none")


def default_mapping(reader: CheckpointReader) -> str:
    """torchtitan for a checkpoint of an architecture torchtitan has (qwen3_moe, deepseek_v3, gpt_oss), else none."""
    return "torchtitan" if reader.index.model.get("arch") in torchtitan.FAMILIES else "none"


@dataclass(frozen=True)
class Part:
    """Box ``box`` of logical tensor ``name`` goes to ``offsets`` of the exported tensor; with ``transpose`` its
    last two dims swapped (torchtitan's gpt-oss experts are ``[E, out, in]``, the plan's ``[E, in, out]``). The
    exported tensor may have more dims in front (see :attr:`target`)."""

    name: str
    box: Box
    offsets: tuple[int, ...]
    transpose: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape this part has in the exported tensor."""
        s = self.box.shape
        return (*s[:-2], s[-1], s[-2]) if self.transpose else s

    @property
    def target(self) -> Box:
        """Where the part goes: at ``offsets``, its :attr:`shape`, with a leading 1 for each dim the exported tensor
        has in front (Megatron's stacked layers: a layer's tensor is one index of the leading dim)."""
        lead = len(self.offsets) - len(self.box.shape)
        return Box(self.offsets, (1,) * lead + self.shape)


@dataclass(frozen=True)
class Source:
    """An exported DCP tensor: its shape and dtype, and the parts of logical tensors it is made of."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return Box.full(self.shape).numel * dtypes.itemsize(self.dtype)


def _whole(reader: CheckpointReader, name: str, box: Box | None = None, transpose: bool = False) -> Source:
    entry = reader.index.tensors[name]
    part = Part(name, box or Box.full(entry.shape), (0,) * len(entry.shape), transpose)
    return Source(part.shape, entry.dtype, (part,))


def _never(name: str) -> bool:
    return False


def _plan_none(reader: CheckpointReader) -> dict[str, Source]:
    return {name: _whole(reader, name) for name in reader.index.tensors}


def _plan_megatron(
    reader: CheckpointReader, optimizer: MegatronOptimizerConfig
) -> tuple[dict[str, Source], dict[str, io.BytesIO], list[str], dict[str, Any]]:
    """Megatron-Core's tensors (each made of parts of logical tensors), its ``ShardedObject`` bytes (DCP writes a
    ``BytesIO`` value as its bytes, as they are: nothing pickled), the notes and the common state."""
    from . import megatron_export

    found = megatron_export.plan(reader, optimizer)
    sources: dict[str, Source] = {}
    for key, (shape, parts) in found.tensors.items():
        dtype = reader.index.tensors[parts[0].name].dtype
        sources[key] = Source(shape, dtype, tuple(Part(p.name, p.box, p.offsets) for p in parts))
    return sources, {key: io.BytesIO(data) for key, data in found.objects.items()}, found.notes, found.common


def _plan_torchtitan(reader: CheckpointReader) -> tuple[dict[str, Source], dict[str, torch.Tensor]]:
    index = reader.index
    family = torchtitan.family(str(index.model.get("arch")), f"{reader.location}: --mapping torchtitan")
    spec = ModelSpec.from_json(index.model)
    untrained = spec.untrained()  # the balancing biases: torchtitan's buffers, no optimizer state
    trained = [p for p in spec.param_specs() if p.name not in untrained]
    out: dict[str, Source] = {}
    roles = [r for r in ("exp_avg", "exp_avg_sq") if all(f"{r}/{p.name}" in index.tensors for p in trained)]
    # a family whose tensors all keep the plan's layout need not say so
    transposed = getattr(family, "transposed", _never)
    for p in spec.param_specs():
        if p.name not in index.tensors:
            raise MappingError(f"{reader.location}: parameter {p.name} of the {spec.arch} model is missing")
        for tt, box in family.export_names(p.name, tuple(p.shape)):
            out[tt] = _whole(reader, p.name, box, transposed(tt))
            if p.name in untrained or family.in_fused_optimizer(tt):
                continue  # no optimizer state, or torchtitan's optimizer holds it fused (below)
            for role in roles:
                out[f"optimizer.state.{tt}.{role}"] = _whole(reader, f"{role}/{p.name}", box, transposed(tt))
    cfg = spec.config
    for fqn, parts in family.export_fused_optimizer(cfg):
        for role in roles:
            dtype = index.tensors[f"{role}/{parts[0][0]}"].dtype
            rows = sum(b.shape[0] for _, b, _ in parts)  # stacked along dim 0: a weight's rows, a bias's entries
            out[f"optimizer.state.{fqn}.{role}"] = Source(
                (rows, *parts[0][1].shape[1:]), dtype, tuple(Part(f"{role}/{n}", b, o) for n, b, o in parts)
            )
    extra = {name: torch.zeros(shape) for name, shape in family.export_extra(cfg).items()}
    return out, extra


class _LazyPlanner:
    """A DCP save planner whose tensors are read from the moeckpt checkpoint when DCP resolves their data."""

    @staticmethod
    def make(
        reader: CheckpointReader,
        sources: dict[str, Source],
        on_bytes: Callable[[int], None] | None,
        raw: frozenset[str] = frozenset(),
    ):
        """``raw``: the keys of ``BytesIO`` values to write as they are (DCP's default planner would ``torch.save``
        them, a pickle of a ``BytesIO`` that no reader of the bytes expects)."""
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            def resolve_data(self, write_item):
                fqn = write_item.index.fqn
                if fqn in raw:
                    return self.lookup_object(write_item.index)
                if fqn not in sources:
                    return super().resolve_data(write_item)
                src = sources[fqn]

                def read(part: Part) -> torch.Tensor:
                    got = reader.read_box(part.name, part.box)
                    return got.transpose(-2, -1) if part.transpose else got

                if len(src.parts) == 1:
                    data = read(src.parts[0]).contiguous().reshape(src.shape)
                else:
                    data = torch.empty(src.shape, dtype=dtypes.to_torch(src.dtype))
                    for part in src.parts:
                        at = part.target
                        data[at.slices()] = read(part).reshape(at.shape)
                if on_bytes is not None:
                    on_bytes(data.numel() * data.element_size())
                return data

        return Planner()


def export_dcp(
    ckpt: str,
    out: str,
    *,
    mapping: str | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
    megatron: MegatronOptimizerConfig | None = None,
) -> dict:
    """Write checkpoint ``ckpt`` as a DCP checkpoint at ``out``; returns ``{"tensors": n, "bytes": b, "mapping": m,
    "notes": [what was not written or was assumed, one sentence each]}``. ``megatron``: the Megatron optimizer to
    write AdamW's state for (``--mapping megatron`` only)."""
    import torch.distributed.checkpoint as dcp

    reader = CheckpointReader(ckpt)
    mapping = mapping or default_mapping(reader)
    if mapping not in EXPORT_MAPPINGS:
        raise MappingError(f"unknown export mapping {mapping!r}; choose one of: {', '.join(EXPORT_MAPPINGS)}")
    megatron = megatron or MegatronOptimizerConfig()
    if mapping != "megatron" and megatron != MegatronOptimizerConfig():
        raise MappingError(
            f"the --megatron-* options describe a Megatron-Core optimizer; they go with --mapping megatron, not "
            f"--mapping {mapping}"
        )
    extra: dict[str, torch.Tensor | io.BytesIO] = {}
    objects: dict[str, io.BytesIO] = {}
    notes: list[str] = []
    common: dict[str, Any] = {}
    if mapping == "none":
        sources = _plan_none(reader)
    elif mapping == "megatron":
        sources, objects, notes, common = _plan_megatron(reader, megatron)
        extra.update(objects)
    else:
        sources, titan = _plan_torchtitan(reader)
        extra.update(titan)
    storage = open_storage(out)
    if not storage.is_local:
        raise MappingError(f"{out}: export-dcp writes to a local directory (torch's FileSystemWriter)")
    storage.refuse_file()
    if storage.exists() and storage.listdir():
        if not overwrite:
            raise DestinationNotEmptyError(f"{storage.location}: destination is not empty; pass --overwrite")
        storage.remove()
    state: dict[str, object] = {}
    for fqn, src in sources.items():
        state[fqn] = torch.empty(src.shape, dtype=dtypes.to_torch(src.dtype), device="meta")
    state.update(extra)
    ts = reader.index.train_state or {}
    found = ts.get(VALUES_KEY)
    values: dict[str, Any] = found if isinstance(found, dict) else {}
    if mapping == "megatron":
        values = {}  # another framework's values (torchtitan's scheduler, dataloader): nothing Megatron reads
    plain: dict[str, Any] = {key: value for key, value in values.items() if key not in state}
    if mapping == "torchtitan":
        steps = (ts.get("optimizer") or {}).get("steps") if isinstance(ts.get("optimizer"), dict) else None
        if isinstance(steps, int):
            for fqn in [k for k in sources if k.startswith("optimizer.state.") and k.endswith(".exp_avg")]:
                state[fqn[: -len("exp_avg")] + "step"] = torch.tensor(float(steps))
        plain.setdefault("train_state.step", reader.index.step)
    # DCP's planner would torch.save (pickle) each non-tensor value; these are plain data (an import keeps only
    # JSON values), written as the torch.load file of their own pickle-free encoder, which DCP's load reads.
    for key, value in plain.items():
        state[key] = io.BytesIO(torch_file(value))
    planner = _LazyPlanner.make(reader, sources, on_bytes, frozenset(objects) | frozenset(plain))
    with warnings.catch_warnings():
        # dcp.save warns that it runs in a single process without a process group: that is what export does.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(storage.location, single_file_per_rank=True, thread_count=1),
            planner=planner,
            no_dist=True,
        )
    if mapping == "megatron":
        from .megatron_export import common_files

        for name, data in common_files(common).items():
            storage.write_bytes(name, data)
    return {
        "tensors": len(sources) + len(extra),
        "bytes": sum(s.nbytes for s in sources.values()),
        "mapping": mapping,
        "notes": notes,
    }
