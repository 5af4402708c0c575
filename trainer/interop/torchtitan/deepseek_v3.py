"""torchtitan's DeepSeek-V3 (``torchtitan.models.deepseek_v3``) <-> the ``deepseek_v3`` plan.

The names map one to one onto the Hugging Face names of the plan (as torchtitan's own ``DeepSeekV3StateDictAdapter``
maps them), except the routed experts (:data:`.shared.EXPERTS`: ``w1``/``w3`` are the blocks of ``gate_up_proj``):

* multi-head latent attention: ``wq`` (no q_lora) or ``wq_a``, ``q_norm``, ``wq_b``; ``wkv_a`` (its last
  ``qk_rope_head_dim`` rows the rotary key shared by every head), ``kv_norm``, ``wkv_b``; ``wo``. torchtitan's
  complex RoPE rotates *interleaved* pairs, as the released DeepSeek weights do, so no row is permuted: the
  Hugging Face config must say ``rope_interleave: true`` (transformers' default for DeepSeek-V3);
* the first ``first_k_dense_replace`` layers' ``feed_forward.w1/w3/w2`` are ``mlp.gate_proj/up_proj/down_proj``;
* a MoE layer's ``moe.shared_experts.w1/w3/w2`` are ``mlp.shared_experts.*``, ``moe.router.gate`` is ``mlp.gate``,
  and its ``moe.expert_bias_E`` (the auxiliary-loss-free balancing bias, a buffer no optimizer steps) is the
  router's ``e_score_correction_bias``: it chooses the experts and does not weigh them, on both sides.

No tensor shape tells the routing (top-k, the expert groups, the scaling factor, whether top-k weights are
normalized) or torchtitan's RMSNorm eps (1e-5): the import needs ``--model`` (the model's Hugging Face
``config.json``), and checks every shape against it. torchtitan's sigmoid router with ``route_norm`` and
``route_scale`` is transformers' ``norm_topk_prob`` and ``routed_scaling_factor``; a softmax-scored torchtitan
model (its debug and 16B flavors) has no DeepSeek-V3 equivalent in transformers, which the config cannot show:
the user's config is trusted there. Multi-token-prediction layers (``mtp_layers.*``) are refused.
"""

from __future__ import annotations

from typing import Any

from moeckpt.formats.box import Box
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.formats.roles import MOMENT_ROLES
from moeckpt.reshard.dcp_source import Slot, whole
from moeckpt.reshard.tensors import logical_tensors

from ...models import ModelSpec
from ...models.deepseek_v3 import ARCH
from ..common import Mapped, MappingError, role_name
from .shared import (
    BIAS,
    EXPERTS,
    LAYER_RE,
    TOP,
    expert_slot,
    export_expert_names,
    optimizer_notes,
    refuse_unfilled,
    split_names,
)
from .shared import train_state as read_train_state

#: per-layer names: torchtitan -> the plan's (Hugging Face's).
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    BIAS[0]: "mlp.gate.e_score_correction_bias",
    BIAS[1]: "mlp.gate.e_score_correction_bias",
}


def looks_like(names) -> bool:
    """Whether torchtitan tensor names are DeepSeek-V3's (latent attention's ``wkv_a``)."""
    return any(n.endswith(".attention.wkv_a.weight") for n in names)


def _plan_name(name: str) -> tuple[str, int | None] | None:
    """(plan name, gate/up block or None) of a torchtitan model tensor; None if it is not DeepSeek-V3's."""
    if name in TOP:
        return TOP[name], None
    m = LAYER_RE.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    if rest in _LAYER:
        return f"model.layers.{layer}.{_LAYER[rest]}", None
    if rest in EXPERTS:
        plan, block = EXPERTS[rest]
        return f"model.layers.{layer}.{plan}", block
    return None


def map_checkpoint(dcp: DcpCheckpoint, model: ModelSpec | None = None) -> Mapped:
    """torchtitan's DeepSeek-V3 checkpoint as a ``deepseek_v3`` model, AdamW moments included."""
    where = dcp.location
    if model is None or model.arch != ARCH:
        raise MappingError(
            f"{where}: a torchtitan DeepSeek-V3 checkpoint needs --model with the model's deepseek_v3 config.json"
            + (f" (got a {model.arch} model)" if model is not None else "")
            + ": no tensor shape tells the routing (num_experts_per_tok, n_group, topk_group, "
            "routed_scaling_factor, norm_topk_prob) or rms_norm_eps (torchtitan's is 1e-5)"
        )
    notes: list[str] = []
    names, opt_keys = split_names(dcp, notes)
    keys: dict[str, tuple[str, int | None]] = {}
    unknown = []
    for name in names:
        found = _plan_name(name)
        if found is None:
            unknown.append(name)
        else:
            keys[name] = found
    if unknown:
        raise MappingError(
            f"{where}: {len(unknown)} tensor(s) are not part of torchtitan's DeepSeek-V3, e.g. {unknown[:3]} "
            "(multi-token-prediction layers are not mapped); use --mapping none to keep them as they are"
        )
    cfg = model.config
    specs = {p.name: tuple(p.shape) for p in model.param_specs()}
    _check_shapes(dcp, keys, specs, cfg.moe_intermediate_size, where)
    untrained = model.untrained()
    dtype = dcp.tensors["tok_embeddings.weight"].dtype
    trained = [n for n, (plan, _) in keys.items() if plan not in untrained]
    moments = {f for f, got in opt_keys.items() if set(MOMENT_ROLES) <= set(got)}
    with_optimizer = dtype == "float32" and bool(trained) and set(trained) == moments
    optimizer_notes(opt_keys, with_optimizer, dtype, notes)
    tensors = logical_tensors(
        list(model.param_specs()),
        param_dtype=dtype,
        with_optimizer=with_optimizer,
        optimizer_roles=(lambda n: () if n in untrained else MOMENT_ROLES) if with_optimizer else (lambda n: ()),
    )
    slots: list[Slot] = []
    for name, (target, block) in keys.items():
        for role in ("param", *(MOMENT_ROLES if with_optimizer and name in moments else ())):
            src = name if role == "param" else opt_keys[name][role]
            shape = dcp.tensors[src].shape
            if block is None:
                slots.append(whole(src, shape, role_name(target, role)))
            else:
                slots.append(expert_slot(src, shape, target, block, role, cfg.moe_intermediate_size))
    state = read_train_state(dcp, opt_keys, trained, with_optimizer, notes)
    return Mapped(model=model.to_json(), tensors=tensors, slots=slots, train_state=state, notes=notes)


def _check_shapes(dcp: DcpCheckpoint, keys: dict, specs: dict[str, tuple[int, ...]], inter: int, where: str) -> None:
    """Every plan tensor filled exactly once, by tensors of the shapes ``--model`` implies."""
    filled: dict[str, list[Any]] = {}
    for name, (plan, block) in keys.items():
        if plan not in specs:
            raise MappingError(
                f"{where}: {name} maps to {plan}, which the --model config does not have (first_k_dense_replace, "
                "num_hidden_layers, q_lora_rank or tie_word_embeddings differ from the checkpoint's)"
            )
        want = specs[plan] if block is None else (specs[plan][0], inter, specs[plan][2])
        got = tuple(dcp.tensors[name].shape)
        if got != want:
            raise MappingError(
                f"{where}: {name} has shape {list(got)} but the --model config gives {plan} the shape {list(want)}; "
                "pass the config the checkpoint was trained with"
            )
        filled.setdefault(plan, []).append(block)
    twice = [p for p, blocks in filled.items() if sorted(blocks, key=str) not in ([None], [0, 1])]
    refuse_unfilled([p for p in specs if p not in filled], twice, where)


# -- the way back -------------------------------------------------------------------------------------------------


def export_names(plan: str, shape: tuple[int, ...]) -> list[tuple[str, Box]]:
    """The torchtitan tensors (name, box of the plan tensor) plan tensor ``plan`` is written as."""
    for tt, hf in TOP.items():
        if plan == hf:
            return [(tt, Box.full(shape))]
    m = LAYER_RE.match(plan.removeprefix("model."))
    if m:
        layer, rest = m.groups()
        experts = export_expert_names(layer, rest, shape)
        if experts is not None:
            return experts
        for tt, hf in _LAYER.items():  # the first spelling of each name is torchtitan 0.3's
            if rest == hf:
                return [(f"layers.{layer}.{tt}", Box.full(shape))]
    raise MappingError(f"{plan}: not a DeepSeek-V3 tensor torchtitan has (multi-token prediction is not mapped)")


def export_extra(cfg) -> dict[str, tuple[int, ...]]:
    """Tensors torchtitan's model has and the plan does not: none (the balancing bias is the correction bias)."""
    return {}


def export_fused_optimizer(cfg) -> list:
    """Optimizer tensors torchtitan fuses where the plan keeps parts: none."""
    return []


def in_fused_optimizer(name: str) -> bool:
    return False
