"""``export-dcp --mapping megatron``: a ``qwen3_moe``, ``mixtral`` or ``deepseek_v3`` checkpoint as Megatron-Core's
``dist_checkpointing`` (``torch_dist``) checkpoint of its GPTModel, the inverse of :mod:`.megatron`'s import.

What ``dist_checkpointing.load(model.sharded_state_dict(), dir)`` needs (Megatron-Core 0.16.1, read from its
``serialization.py`` and ``strategies/{torch,common}.py``):

* ``metadata.json`` naming the backends (``torch_dist`` for the tensors, ``torch`` for the common state): without
  it the directory "is not a distributed checkpoint";
* ``common.pt``, the non-sharded state, read with ``torch.load``; it must exist (a missing one fails the load).
  A GPTModel's common state is empty, so this is ``{}``, written by :mod:`moeckpt.formats.dcp.plain_pickle`;
* a torch DCP checkpoint (``.metadata``, ``__0_0.distcp``) holding every *sharded key* the model asks for at its
  global shape. Megatron reads it with DCP's own resharding load, so one chunk per tensor serves any TP, EP or
  PP degree of the loading model; replica ids and ``flattened_range`` only matter to the saver (and to the
  distributed optimizer's legacy flat format, not written here);
* every module's ``_extra_state`` as a ``ShardedObject`` (DCP bytes, one per shard of the module's grid:
  ``<key>/shard_<layer>_<layers>``, ``shard_<layer>.<expert>_<layers>.<experts>`` for experts), because DCP's
  load refuses a requested key the checkpoint lacks. Without FP8 each is ``[None]`` (what Megatron itself saves).

The names are those of Megatron's local (and Transformer Engine) GPT layer spec with SequentialMLP experts:
Qwen3-MoE and Mixtral (every layer a MoE layer) stack their layers along a leading dim
(``decoder.layers.self_attention.linear_qkv.weight [L, ...]``); DeepSeek-V3 (``moe_layer_freq`` a list, its
first layers dense) has one key per layer (``decoder.layers.<i>.``), as Megatron names them.

With a :class:`~.megatron_optimizer.MegatronOptimizerConfig` that names an optimizer form, AdamW's state goes with
them: ``optimizer.state.<state>.<key>`` beside every trained key, from the moments and masters of the same parts,
and ``common.pt`` holds the optimizer's common state (param groups, step; :mod:`.megatron_optimizer`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from moeckpt.formats.box import Box
from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.dcp.plain_pickle import torch_file

from ..models import ModelSpec
from ..models.deepseek_v3 import ARCH as DEEPSEEK_V3
from ..models.mixtral import ARCH as MIXTRAL
from ..models.qwen3_moe import ARCH as QWEN3_MOE
from . import megatron_optimizer as mopt
from .common import MappingError, role_name
from .megatron import METADATA_JSON
from .megatron_optimizer import Group, MegatronOptimizerConfig

#: the plan architectures Megatron's GPTModel is written as (the families the import maps).
FAMILIES = (QWEN3_MOE, MIXTRAL, DEEPSEEK_V3)
#: Megatron-Core's name of the common state file (``strategies/common.py``).
COMMON_PT = "common.pt"
#: what ``metadata.json`` says: the tensors in torch DCP, the common state for ``torch.load``.
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}  # fmt: skip

_TOP = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}
#: Qwen3-MoE and Mixtral: a layer's tensors, whole, under the names the local spec saves (its layer norms under
#: the Transformer Engine names: they are fused into the next linear there).
_GQA_LAYER = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "mlp.gate.weight": "mlp.router.weight",
}
#: DeepSeek-V3 (multi-latent attention): a layer's tensors, whole.
_MLA_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.q_proj.weight": "self_attention.linear_q_proj.weight",
    "self_attn.q_a_proj.weight": "self_attention.linear_q_down_proj.weight",
    "self_attn.q_a_layernorm.weight": "self_attention.q_layernorm.weight",
    "self_attn.q_b_proj.weight": "self_attention.linear_q_up_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "self_attention.linear_kv_down_proj.weight",
    "self_attn.kv_a_layernorm.weight": "self_attention.kv_layernorm.weight",
    "self_attn.kv_b_proj.weight": "self_attention.linear_kv_up_proj.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.e_score_correction_bias": "mlp.router.expert_bias",
    "mlp.shared_experts.down_proj.weight": "mlp.shared_experts.linear_fc2.weight",
}
#: DeepSeek-V3: the plan's separate gate and up -> a swiglu ``linear_fc1`` (gate rows, then up rows).
_MLA_FUSED = {
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", 0),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", 1),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.linear_fc1.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.linear_fc1.weight", 1),
}
#: the experts (SequentialMLP's keys; the plan's gate_up_proj already has Megatron's gate rows, then up rows).
_EXPERTS = {
    "mlp.experts.gate_up_proj": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.down_proj": "mlp.experts.experts.linear_fc2.weight",
}
_QKV = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: a module whose ``_extra_state`` Megatron saves: its linear layers (``linear_qkv``, ``linear_fc1``, ...).
_LINEAR_RE = re.compile(r"^(.*\.linear_\w+)\.weight$")


class Part(NamedTuple):
    """Box ``box`` of logical tensor ``name`` goes to ``offsets`` of a Megatron tensor."""

    name: str
    box: Box
    offsets: tuple[int, ...]


class MegatronPlan(NamedTuple):
    """What an export writes: each Megatron tensor's shape and parts, each ``ShardedObject``'s bytes, and the
    common state (``common.pt``)."""

    tensors: dict[str, tuple[tuple[int, ...], list[Part]]]
    objects: dict[str, bytes]
    #: what is not written, or was assumed, one sentence each (the CLI prints them).
    notes: list[str]
    #: Megatron's common state: ``{}`` for a model, its optimizer's entry and the content metadata with one.
    common: dict[str, Any]


def plan(reader: CheckpointReader, optimizer: MegatronOptimizerConfig | None = None) -> MegatronPlan:
    """The Megatron-Core tensors and objects of checkpoint ``reader`` (a qwen3_moe, mixtral or deepseek_v3 model),
    with AdamW's state for the optimizer ``optimizer`` names (none by default)."""
    optimizer = optimizer or MegatronOptimizerConfig()
    where = f"{reader.location}: --mapping megatron"
    arch = str(reader.index.model.get("arch"))
    if arch not in FAMILIES:
        raise MappingError(
            f"{where}: Megatron-Core's GPTModel is written for {', '.join(FAMILIES)} models; this one is {arch!r} "
            "(use --mapping none)"
        )
    spec = ModelSpec.from_json(reader.index.model)
    layers = spec.config.num_hidden_layers
    stacked = arch != DEEPSEEK_V3
    tensors: dict[str, tuple[tuple[int, ...], list[Part]]] = {}
    #: each Megatron key's optimizer group (what its parameters are to Megatron's param groups); untrained: none
    groups: dict[str, Group | None] = {}
    untrained = spec.untrained()

    def put(key: str, inner: tuple[int, ...], layer: int | None, name: str, box: Box, at: tuple[int, ...]) -> None:
        if layer is not None and stacked:  # the leading layer dim of a stacked key
            key, inner, at = f"decoder.layers.{key}", (layers, *inner), (layer, *at)
        elif layer is not None:
            key = f"decoder.layers.{layer}.{key}"
        have, parts = tensors.setdefault(key, (inner, []))
        if have != inner:  # two plan tensors of different shapes into one Megatron key: a bug, not bad input
            raise MappingError(f"{where}: {name} makes {key} {list(inner)}, another tensor made it {list(have)}")
        parts.append(Part(name, box, at))
        groups[key] = None if name in untrained else _group_of(name, len(reader.index.tensors[name].shape))

    for p in spec.param_specs():
        if p.name not in reader.index.tensors:
            raise MappingError(f"{where}: parameter {p.name} of the {arch} model is missing from the checkpoint")
        shape = tuple(p.shape)
        full = Box.full(shape)
        zero = (0,) * len(shape)
        if p.name in _TOP:
            put(_TOP[p.name], shape, None, p.name, full, zero)
            continue
        m = _LAYER_RE.match(p.name)
        rest = m.group(2) if m else ""
        layer = int(m.group(1)) if m else None
        table = _GQA_LAYER if stacked else _MLA_LAYER
        if rest in table:
            put(table[rest], shape, layer, p.name, full, zero)
        elif rest in _EXPERTS:
            put(_EXPERTS[rest], shape, layer, p.name, full, zero)
        elif not stacked and rest in _MLA_FUSED:
            key, block = _MLA_FUSED[rest]
            rows, cols = shape
            put(key, (2 * rows, cols), layer, p.name, full, (block * rows, 0))
        elif stacked and rest in _QKV:
            _put_qkv(put, spec.config, layer, rest, p.name, shape)
        else:
            raise MappingError(
                f"{where}: {p.name} has no place in Megatron's GPTModel as moeckpt writes it "
                "(multi-token prediction layers, biases); use --mapping none"
            )
    _check_filled(tensors, where)
    objects = _extra_states(tensors, stacked, layers)
    if optimizer.optimizer == "none":
        roles = sorted({t.role for t in reader.index.tensors.values()} - {"param"})
        notes = (
            [
                f"optimizer state ({', '.join(roles)}) not written: pass --megatron-optimizer plain or "
                "fully_reshardable (the optimizer of the Megatron run that loads it) to write it for Megatron's "
                "optimizer; the export holds the parameters"
            ]
            if roles
            else []
        )
        return MegatronPlan(tensors, objects, notes, {})
    return _with_optimizer(reader, optimizer, MegatronPlan(tensors, objects, [], {}), groups, where)


def _group_of(name: str, dims: int) -> Group:
    """The group a plan parameter's Megatron parameters fall in: a routed expert's or not, and whether it is
    decayed (Megatron's standard overrides: parameters of one dimension and biases are not). A plan's experts are
    ``[E, ...]``: each of Megatron's expert parameters has one dimension fewer."""
    m = _LAYER_RE.match(name)
    expert = m is not None and m.group(2) in _EXPERTS
    return Group(expert, dims - expert == 1 or name.endswith(".bias"))


def _with_optimizer(
    reader: CheckpointReader,
    config: MegatronOptimizerConfig,
    found: MegatronPlan,
    groups: dict[str, Group | None],
    where: str,
) -> MegatronPlan:
    """``found`` with AdamW's state for the optimizer ``config`` names: an ``optimizer.state.<state>.<key>``
    tensor beside every trained key, made of the same parts of the moments and masters, and the common state."""
    form = config.optimizer
    dtype = reader.index.tensors[found.tensors["embedding.word_embeddings.weight"][1][0].name].dtype
    mopt.check_dtype(form, dtype, where)
    values = mopt.resolve(config, reader.index.train_state, where)
    tensors = dict(found.tensors)
    for key, (shape, parts) in found.tensors.items():
        if groups[key] is None:
            continue  # a buffer to Megatron (DeepSeek-V3's expert_bias): no optimizer state
        for state, role in mopt.state_roles(form, dtype).items():
            names = [p.name if role == "param" else role_name(p.name, role) for p in parts]
            for name in names:
                entry = reader.index.tensors.get(name)
                if entry is None:
                    raise MappingError(
                        f"{where}: --megatron-optimizer {form} needs {name}, which the checkpoint does not hold (it "
                        "has no complete AdamW state"
                        + (", or no fp32 masters for its bf16 parameters" if role == "master" else "")
                        + "); export without --megatron-optimizer"
                    )
                if role != "param" and entry.dtype != "float32":
                    raise MappingError(f"{where}: {name} is {entry.dtype}; Megatron's optimizer keeps it in float32")
            tensors[f"optimizer.state.{state}.{key}"] = (
                shape,
                [Part(name, p.box, p.offsets) for name, p in zip(names, parts)],
            )
    subs = mopt.groups_of([g for g in groups.values() if g is not None], config.ep)
    common = {
        "optimizer": mopt.common_state(form, dtype, subs, values),
        "content_metadata": mopt.content_metadata(form),
    }
    note = (
        f"Megatron optimizer state written for --megatron-optimizer {form}, expert-parallel size {config.ep} "
        f"({len(subs)} sub-optimizer(s)), with {values.describe()}: a Megatron run loads it with these values"
    )
    return MegatronPlan(tensors, found.objects, [note], common)


def _put_qkv(put: Callable[..., None], cfg: Any, layer: int | None, rest: str, name: str, shape: tuple[int, ...]):
    """q, k or v into Megatron's ``linear_qkv``, fused per query group: for each of the G groups its H/G query
    heads, then one key head, then one value head (the inverse of :func:`.common.qkv_group_slots`)."""
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    qpg = cfg.num_attention_heads // groups
    hidden = shape[-1]
    rows = (cfg.num_attention_heads + 2 * groups) * hd
    for g in range(groups):
        base = g * (qpg + 2) * hd
        if rest == "self_attn.q_proj.weight":
            lo, n, at = g * qpg * hd, qpg * hd, base
        elif rest == "self_attn.k_proj.weight":
            lo, n, at = g * hd, hd, base + qpg * hd
        else:
            lo, n, at = g * hd, hd, base + (qpg + 1) * hd
        put("self_attention.linear_qkv.weight", (rows, hidden), layer, name, Box((lo, 0), (n, hidden)), (at, 0))


def _check_filled(tensors: dict[str, tuple[tuple[int, ...], list[Part]]], where: str) -> None:
    """Every Megatron tensor is covered exactly by its parts (a config whose head counts or sizes do not add up
    would leave rows unwritten)."""
    for key, (shape, parts) in tensors.items():
        have = sum(part.box.numel for part in parts)
        if have != Box.full(shape).numel:
            raise MappingError(
                f"{where}: {key} (shape {list(shape)}) is not filled exactly by the model's tensors "
                f"({have} of {Box.full(shape).numel} values); its config does not fit Megatron's fused layout"
            )


def _extra_states(tensors: dict[str, tuple[tuple[int, ...], list[Part]]], stacked: bool, layers: int):
    """The ``_extra_state`` ``ShardedObject`` of every linear module, one per cell of its grid (the layer for a
    stacked key, the expert for an experts key), each Megatron's empty state ``[None]``."""
    empty = torch_file([None], "archive")  # the list of the objects of one key, as Megatron's torch saver packs it
    out: dict[str, bytes] = {}
    for key in tensors:
        m = _LINEAR_RE.match(key)
        if m is None:
            continue
        grid: tuple[int, ...] = (layers,) if stacked else ()
        if ".experts.experts." in key:
            grid += (tensors[key][0][1 if stacked else 0],)
        if not grid:
            grid = (1,)
        for cell in itertools.product(*map(range, grid)):
            offsets, sizes = ".".join(map(str, cell)), ".".join(map(str, grid))
            out[f"{m.group(1)}._extra_state/shard_{offsets}_{sizes}"] = empty
    return out


def common_files(common: dict[str, Any]) -> dict[str, bytes]:
    """The files beside the DCP ones, in the order to write them: the common state ``common.pt`` (a model's is
    empty), then ``metadata.json``, last, since without it Megatron takes the directory for no checkpoint at all."""
    import json

    return {COMMON_PT: torch_file(common, "common"), METADATA_JSON: json.dumps(BACKENDS).encode()}
