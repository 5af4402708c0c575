"""torchtitan's gpt-oss (``torchtitan.models.gpt_oss``) <-> the ``gpt_oss`` plan.

The names map one to one onto the Hugging Face names of the plan (as torchtitan's own ``GptOssStateDictAdapter``
maps them), the Q/K/V weights and biases saved split (``qkv_linear.wq``/``wk``/``wv``) by torchtitan's state-dict
hook, the attention ``sinks`` one logit per query head on both sides. Two things differ:

* the expert matrices: torchtitan's ``GptOssGroupedExperts`` holds ``mlp1_weight_EGD [E, 2I, H]`` and
  ``mlp2_weight_EDF [E, H, I]`` (out, in), the plan ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``
  (in, out): the same matrices transposed, so they are read and written transposed (dim 0, the expert, stays, so
  an expert of a DCP chunk is still one contiguous run of bytes). Gate and up interleave along ``2I`` in both (gate channel
  ``j`` at ``2j``, up at ``2j + 1``: torchtitan's ``swiglu`` takes ``[..., ::2]`` and ``[..., 1::2]``, as
  transformers does), and the expert biases ``mlp1_bias_EG``/``mlp2_bias_ED`` are the plan's as they are. torchtitan
  0.3's adapter maps no expert tensor to a bf16 Hugging Face name (its names are the MXFP4 ``*_blocks``, without
  the ``_EGD`` suffix its parameters have), so this transposition is the mapping, not a copy of its;
* the optimizer state of the fused ``qkv_linear.wqkv`` weight and bias, per key/value group (its query heads, one
  key head, one value head), which torchtitan's model state saves split and its flattened optimizer does not.

``moe.expert_bias_E`` (auxiliary-loss-free load balancing, a buffer torchtitan's gpt-oss flavors have) must be
zero: gpt-oss routes with the router's bias only, so a trained balancing bias would change what the model
computes; export writes it back as zeros. No tensor shape tells the routing (``num_experts_per_tok``), the sliding
window and which layers have it, the RoPE (YaRN) parameters or ``swiglu_limit``: the import needs ``--model`` (the
model's Hugging Face ``config.json``) and checks every shape against it.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.formats.roles import MOMENT_ROLES
from moeckpt.reshard.dcp_source import Slot, whole
from moeckpt.reshard.tensors import logical_tensors

from ...models import ModelSpec
from ...models.gpt_oss import ARCH
from ..common import Mapped, MappingError, check_covers, qkv_group_slots, role_name
from .shared import BIAS, LAYER_RE, TOP, fused_qkv_parts, optimizer_notes, refuse_unfilled, split_names
from .shared import train_state as read_train_state

_EXPERTS = "moe.routed_experts.inner_experts."
#: per-layer names kept as they are: torchtitan -> the plan's (Hugging Face's).
_LAYER = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wq.bias": "self_attn.q_proj.bias",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wk.bias": "self_attn.k_proj.bias",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.qkv_linear.wv.bias": "self_attn.v_proj.bias",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    _EXPERTS + "mlp1_bias_EG": "mlp.experts.gate_up_proj_bias",
    _EXPERTS + "mlp2_bias_ED": "mlp.experts.down_proj_bias",
}
#: the expert matrices, ``[E, out, in]`` in torchtitan and ``[E, in, out]`` in the plan: moved transposed.
_TRANSPOSED = {
    _EXPERTS + "mlp1_weight_EGD": "mlp.experts.gate_up_proj",
    _EXPERTS + "mlp2_weight_EDF": "mlp.experts.down_proj",
}
#: the fused Q/K/V parameters (``weight``, ``bias``) whose optimizer state torchtitan keeps fused.
_WQKV = re.compile(r"^layers\.(\d+)\.attention\.qkv_linear\.wqkv\.(weight|bias)$")


def looks_like(names) -> bool:
    """Whether torchtitan tensor names are gpt-oss's (the attention sinks, which no other family has)."""
    return any(n.endswith(".attention.sinks") for n in names)


def _plan_name(name: str) -> tuple[str, bool] | str | None:
    """(plan name, whether it is moved transposed) of a torchtitan model tensor; ``"bias"`` for the balancing bias;
    None if it is not gpt-oss's."""
    if name in TOP:
        return TOP[name], False
    m = LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    if rest in BIAS:
        return "bias"
    for names, transposed in ((_LAYER, False), (_TRANSPOSED, True)):
        if rest in names:
            return f"model.layers.{layer}.{names[rest]}", transposed
    return None


def map_checkpoint(dcp: DcpCheckpoint, model: ModelSpec | None = None) -> Mapped:
    """torchtitan's gpt-oss checkpoint as a ``gpt_oss`` model, AdamW moments included."""
    where = dcp.location
    if model is None or model.arch != ARCH:
        raise MappingError(
            f"{where}: a torchtitan gpt-oss checkpoint needs --model with the model's gpt_oss config.json"
            + (f" (got a {model.arch} model)" if model is not None else "")
            + ": no tensor shape tells the routing (num_experts_per_tok), the sliding window (sliding_window, "
            "layer_types), the RoPE parameters or swiglu_limit"
        )
    notes: list[str] = []
    names, opt_keys = split_names(dcp, notes)
    keys: dict[str, tuple[str, bool]] = {}
    unknown, biases = [], []
    for name in names:
        found = _plan_name(name)
        if found == "bias":
            biases.append(name)
        elif isinstance(found, tuple):
            keys[name] = found
        else:
            unknown.append(name)
    if unknown:
        raise MappingError(
            f"{where}: {len(unknown)} tensor(s) are not part of torchtitan's gpt-oss, e.g. {unknown[:3]}; use "
            "--mapping none to keep them as they are"
        )
    _check_shapes(dcp, keys, {p.name: tuple(p.shape) for p in model.param_specs()}, where)
    _drop_zero_biases(dcp, biases, where, notes)
    cfg = model.config
    dtype = dcp.tensors["tok_embeddings.weight"].dtype
    slots = [_slot(name, tuple(dcp.tensors[name].shape), plan, t, "param") for name, (plan, t) in keys.items()]
    opt_slots, opt_fqns = _optimizer_slots(dcp, opt_keys, cfg)
    plan_names = {plan for plan, _ in keys.values()}
    with_optimizer = dtype == "float32" and {s.target.split("/", 1)[1] for s in opt_slots} == plan_names
    optimizer_notes(opt_keys, with_optimizer, dtype, notes)
    tensors = logical_tensors(list(model.param_specs()), param_dtype=dtype, with_optimizer=with_optimizer)
    if with_optimizer:
        slots += opt_slots
    check_covers(tensors, slots, dcp, where)
    state = read_train_state(dcp, opt_keys, opt_fqns, with_optimizer, notes)
    return Mapped(model=model.to_json(), tensors=tensors, slots=slots, train_state=state, notes=notes)


def _slot(source: str, shape: tuple[int, ...], plan: str, transposed: bool, role: str) -> Slot:
    target = role_name(plan, role)
    if transposed:
        return Slot(source, Box.full(shape), target, (0,) * len(shape), transpose=True)
    return whole(source, shape, target)


def _optimizer_slots(dcp: DcpCheckpoint, opt_keys: dict, cfg) -> tuple[list[Slot], list[str]]:
    """The slots of the AdamW moments (the fused ``wqkv`` ones split per key/value group), and the parameters
    (torchtitan's names) they belong to."""
    slots: list[Slot] = []
    fqns = []
    for fqn, got in opt_keys.items():
        if not set(MOMENT_ROLES) <= set(got):
            continue
        fused = _WQKV.match(fqn)
        plan = None if fused else _plan_name(fqn)
        if not fused and not isinstance(plan, tuple):
            continue  # state of no gpt-oss parameter: the coverage check below leaves the optimizer out
        fqns.append(fqn)
        for role in MOMENT_ROLES:
            src = got[role]
            shape = tuple(dcp.tensors[src].shape)
            if fused:
                layer, param = fused.groups()
                slots += qkv_group_slots(src, shape, None, f"model.layers.{layer}.", role, cfg, param)
            elif isinstance(plan, tuple):
                slots.append(_slot(src, shape, plan[0], plan[1], role))
    return slots, fqns


def _check_shapes(dcp: DcpCheckpoint, keys: dict, specs: dict[str, tuple[int, ...]], where: str) -> None:
    """Every plan tensor filled exactly once, by a tensor of the shape ``--model`` implies (transposed for the
    expert matrices)."""
    filled: dict[str, int] = {}
    for name, (plan, transposed) in keys.items():
        if plan not in specs:
            raise MappingError(
                f"{where}: {name} maps to {plan}, which the --model config does not have (num_hidden_layers or "
                "tie_word_embeddings differ from the checkpoint's)"
            )
        want = specs[plan]
        if transposed:
            want = (*want[:-2], want[-1], want[-2])
        got = tuple(dcp.tensors[name].shape)
        if got != want:
            layout = f" (in torchtitan's [E, out, in] order {list(want)})" if transposed else ""
            raise MappingError(
                f"{where}: {name} has shape {list(got)} but the --model config gives {plan} the shape "
                f"{list(specs[plan])}{layout}; pass the config the checkpoint was trained with"
            )
        filled[plan] = filled.get(plan, 0) + 1
    refuse_unfilled([p for p in specs if p not in filled], [p for p, n in filled.items() if n > 1], where)


def _drop_zero_biases(dcp: DcpCheckpoint, biases: list[str], where: str, notes: list[str]) -> None:
    """Refuse a trained load-balancing bias (gpt-oss computes none); leave zero ones out with a note."""
    for name in biases:
        if torch.count_nonzero(dcp.read_tensor(name)).item():
            raise MappingError(
                f"{where}: {name} is not zero: the model was trained with auxiliary-loss-free expert biases, which "
                "gpt-oss does not compute; converting would change its routing"
            )
    if biases:
        notes.append(f"{len(biases)} expert_bias tensor(s), all zero (gpt-oss routes without one), were dropped")


# -- the way back -------------------------------------------------------------------------------------------------


def export_names(plan: str, shape: tuple[int, ...]) -> list[tuple[str, Box]]:
    """The torchtitan tensors (name, box of the plan tensor) plan tensor ``plan`` is written as."""
    for tt, hf in TOP.items():
        if plan == hf:
            return [(tt, Box.full(shape))]
    m = LAYER_RE.match(plan.removeprefix("model."))
    if m:
        layer, rest = m.groups()
        for names in (_LAYER, _TRANSPOSED):
            for tt, hf in names.items():
                if rest == hf:
                    return [(f"layers.{layer}.{tt}", Box.full(shape))]
    raise MappingError(f"{plan}: not a gpt-oss tensor torchtitan has")


def transposed(name: str) -> bool:
    """Whether torchtitan tensor ``name`` holds its plan tensor with the last two dims swapped."""
    return name.endswith(tuple(_TRANSPOSED))


def export_extra(cfg) -> dict[str, tuple[int, ...]]:
    """Tensors torchtitan's model has and gpt-oss does not: the (zero) load-balancing bias of every layer."""
    return {f"layers.{i}.{BIAS[0]}": (cfg.num_local_experts,) for i in range(cfg.num_hidden_layers)}


def export_fused_optimizer(cfg) -> list[tuple[str, list[Any]]]:
    """The optimizer tensors torchtitan holds fused where the plan keeps parts: every layer's ``wqkv`` weight and
    bias."""
    return [
        (f"layers.{layer}.attention.qkv_linear.wqkv.{param}", fused_qkv_parts(layer, cfg, param))
        for layer in range(cfg.num_hidden_layers)
        for param in ("weight", "bias")
    ]


def in_fused_optimizer(name: str) -> bool:
    """Whether torchtitan name ``name`` (a model tensor) has its optimizer state in a fused tensor instead."""
    return bool(re.search(r"\.qkv_linear\.w[qkv]\.(weight|bias)$", name))
