"""torchtitan's Qwen3-MoE (``torchtitan.models.qwen3``) <-> the bundled ``qwen3_moe`` architecture.

torchtitan's checkpoint (``CheckpointManager``, or ``dcp.save`` of its states) holds the model's state dict at the
top level, the optimizer flattened by parameter (``optimizer.state.<fqn>.exp_avg``, ``.exp_avg_sq``, ``.step``;
``optimizer.param_groups.<fqn>.lr``...), and ``train_state.step``, ``lr_scheduler.*``, ``dataloader.*`` values.
Its names map one to one onto the Hugging Face names of our plan, except the experts (see
:data:`.shared.EXPERTS`) and the fused ``wqkv`` of its optimizer state. Older torchtitan names (``attention.wq``,
``moe.experts.w1``) are read too. ``moe.expert_bias_E`` (auxiliary-loss-free balancing) must be zero: Qwen3-MoE
routes without a bias, so a trained bias would change what the model computes.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.reshard.dcp_source import Slot, whole

from ...models import ModelSpec
from ...models.qwen3_moe import ARCH
from ..common import (
    Mapped,
    MappingError,
    check_shapes,
    qkv_group_slots,
    qwen3_config,
    qwen3_tensors,
    role_name,
)
from .shared import BIAS as _BIAS
from .shared import EXPERTS as _EXPERTS
from .shared import LAYER_RE as _LAYER_RE
from .shared import TOP as _TOP
from .shared import expert_slot, export_expert_names, optimizer_notes, split_names, train_state

#: per-layer names, torchtitan 0.3 first (the names export writes), then older spellings.
_LAYER = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
}
#: the fused Q/K/V parameter (per key/value group); its model state is saved split, its optimizer state is not.
_WQKV = "attention.qkv_linear.wqkv.weight"


def _plan_name(name: str) -> tuple[str, int | str | None] | str | None:
    """(plan name, gate/up block) of a torchtitan model tensor; ``"bias"`` for the expert bias; None if unknown."""
    if name in _TOP:
        return _TOP[name], None
    m = _LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    if rest in _BIAS:
        return "bias"
    if rest == _WQKV:
        return f"model.layers.{layer}.", "qkv"
    if rest in _LAYER:
        return f"model.layers.{layer}.{_LAYER[rest]}", None
    if rest in _EXPERTS:
        plan, block = _EXPERTS[rest]
        return f"model.layers.{layer}.{plan}", block
    return None


def map_checkpoint(dcp: DcpCheckpoint, model: ModelSpec | None = None) -> Mapped:
    """torchtitan's Qwen3-MoE checkpoint as the bundled ``qwen3_moe`` model, optimizer moments included."""
    where = dcp.location
    notes: list[str] = []
    model_keys: dict[str, Any] = {}
    unknown: list[str] = []
    biases: list[str] = []
    names, opt_keys = split_names(dcp, notes)
    for name in names:
        plan = _plan_name(name)
        if plan == "bias":
            biases.append(name)
        elif plan is None:
            unknown.append(name)
        else:
            model_keys[name] = plan
    if unknown:
        raise MappingError(
            f"{where}: {len(unknown)} tensor(s) are not part of torchtitan's Qwen3-MoE, e.g. {unknown[:3]} (dense "
            "feed-forward and shared experts are not in the bundled qwen3_moe); use --mapping none to keep them as they are"
        )
    if "tok_embeddings.weight" not in model_keys:
        raise MappingError(f"{where}: no tok_embeddings.weight: not a torchtitan model checkpoint (try --mapping none)")
    for name in biases:
        if torch.count_nonzero(dcp.read_tensor(name)).item():
            raise MappingError(
                f"{where}: {name} is not zero: the model was trained with auxiliary-loss-free expert biases, which "
                "Qwen3-MoE does not compute; converting would change its routing"
            )
    if biases:
        notes.append(f"{len(biases)} expert_bias tensor(s), all zero (Qwen3-MoE routes without a bias), were dropped")
    cfg = qwen3_config(_shapes(dcp, model_keys, where), "lm_head.weight" not in model_keys, model, where, notes)
    dtype = dcp.tensors["tok_embeddings.weight"].dtype
    opt_params = {}
    for fqn in opt_keys:
        plan = _plan_name(fqn)
        if isinstance(plan, tuple):
            opt_params[fqn] = plan
    moments = {fqn for fqn, got in opt_keys.items() if {"exp_avg", "exp_avg_sq"} <= set(got)}
    with_optimizer = (
        bool(opt_params) and set(opt_params) <= moments and _covers(opt_params, model_keys) and (dtype == "float32")
    )
    optimizer_notes(opt_keys, with_optimizer, dtype, notes)
    tensors = qwen3_tensors(cfg, dtype, with_optimizer)
    slots = []
    for name, (plan, block) in model_keys.items():
        slots += _slots(name, dcp.tensors[name].shape, plan, block, "param", cfg)
    if with_optimizer:
        for fqn, (plan, block) in opt_params.items():
            for role in ("exp_avg", "exp_avg_sq"):
                src = opt_keys[fqn][role]
                slots += _slots(src, dcp.tensors[src].shape, plan, block, role, cfg)
    check_shapes(tensors, slots, dcp, where)
    state = train_state(dcp, opt_keys, opt_params, with_optimizer, notes)
    return Mapped(
        model={"arch": ARCH, "config": cfg.to_json()}, tensors=tensors, slots=slots, train_state=state, notes=notes
    )


def _covers(opt_params: dict, model_keys: dict) -> bool:
    """Whether the optimizer's parameters are exactly the model's (the fused wqkv standing for wq, wk and wv)."""

    def targets(plans) -> set[str]:
        out = set()
        for plan, block in plans:
            if block == "qkv":
                out |= {f"{plan}self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")}
            else:
                out.add(plan)
        return out

    return targets(opt_params.values()) == targets(model_keys.values())


def _slots(source: str, shape: tuple[int, ...], plan: str, block: int | str | None, role: str, cfg) -> list[Slot]:
    if block == "qkv":  # plan is the layer prefix
        return qkv_group_slots(source, shape, None, plan, role, cfg)
    if not isinstance(block, int):
        return [whole(source, shape, role_name(plan, role))]
    return [expert_slot(source, shape, plan, block, role, cfg.moe_intermediate_size)]


def _shapes(dcp: DcpCheckpoint, keys: dict, where: str) -> dict[str, int]:
    def shape(name: str) -> tuple[int, ...]:
        if name not in dcp.tensors:
            raise MappingError(f"{where}: tensor {name} is missing")
        return dcp.tensors[name].shape

    vocab, hidden = shape("tok_embeddings.weight")
    layers = 1 + max((int(m.group(1)) for n in keys if (m := _LAYER_RE.match(n))), default=-1)
    q = next(
        (n for n in ("layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.wq.weight") if n in keys), None
    )
    w1 = next(
        (n for n in ("layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.experts.w1") if n in keys), None
    )
    if q is None or w1 is None or "layers.0.attention.q_norm.weight" not in keys:
        raise MappingError(f"{where}: layer 0 lacks attention or expert tensors of a Qwen3-MoE model")
    (head_dim,) = shape("layers.0.attention.q_norm.weight")
    k = q.replace("wq", "wk")
    experts, inter, _ = shape(w1)
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "head_dim": head_dim,
        "num_attention_heads": shape(q)[0] // head_dim,
        "num_key_value_heads": shape(k)[0] // head_dim,
        "num_experts": experts,
        "moe_intermediate_size": inter,
    }


# -- the way back: names of an export ---------------------------------------------------------------------------


def export_names(plan: str, shape: tuple[int, ...]) -> list[tuple[str, Box]]:
    """The torchtitan tensors (name, box of the plan tensor) plan tensor ``plan`` is written as."""
    for tt, hf in _TOP.items():
        if plan == hf:
            return [(tt, Box.full(shape))]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", plan)
    if not m:
        raise MappingError(f"{plan}: not a Qwen3-MoE tensor torchtitan has")
    layer, rest = m.groups()
    experts = export_expert_names(layer, rest, shape)
    if experts is not None:
        return experts
    for tt, hf in _LAYER.items():  # the first spelling of each name is torchtitan 0.3's
        if rest == hf:
            return [(f"layers.{layer}.{tt}", Box.full(shape))]
    raise MappingError(f"{plan}: not a Qwen3-MoE tensor torchtitan has")


def export_extra(cfg) -> dict[str, tuple[int, ...]]:
    """Tensors torchtitan's model has and Qwen3-MoE does not: the (zero) expert biases of every MoE layer."""
    return {f"layers.{i}.moe.expert_bias_E": (cfg.num_experts,) for i in range(cfg.num_hidden_layers)}


def export_wqkv(layer: int, cfg) -> tuple[str, list[tuple[str, Box, tuple[int, int]]]]:
    """torchtitan's fused ``wqkv`` of a layer (per key/value group: its query heads, one key head, one value
    head) as parts ``(plan tensor, box of it, offsets in wqkv)``: how its optimizer state is exported."""
    hd, groups, h = cfg.head_dim, cfg.num_key_value_heads, cfg.hidden_size
    qpg = cfg.num_attention_heads // groups
    pre = f"model.layers.{layer}.self_attn."
    parts = []
    for g in range(groups):
        base = g * (qpg + 2) * hd
        parts += [
            (pre + "q_proj.weight", Box((g * qpg * hd, 0), (qpg * hd, h)), (base, 0)),
            (pre + "k_proj.weight", Box((g * hd, 0), (hd, h)), (base + qpg * hd, 0)),
            (pre + "v_proj.weight", Box((g * hd, 0), (hd, h)), (base + (qpg + 1) * hd, 0)),
        ]
    return f"layers.{layer}.{_WQKV}", parts


def export_fused_optimizer(cfg) -> list[tuple[str, list[tuple[str, Box, tuple[int, int]]]]]:
    """The optimizer tensors torchtitan holds fused where the plan keeps parts: every layer's ``wqkv``."""
    return [export_wqkv(layer, cfg) for layer in range(cfg.num_hidden_layers)]


def in_fused_optimizer(name: str) -> bool:
    """Whether torchtitan name ``name`` (a model tensor) has its optimizer state in a fused tensor instead."""
    return name.endswith(("wq.weight", "wk.weight", "wv.weight"))
