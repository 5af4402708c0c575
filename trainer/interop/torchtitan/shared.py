"""What torchtitan's model families share in a checkpoint: the top-level names, the grouped experts' layout, the
flattened optimizer and the train state (``train_state.step``, AdamW's per-parameter ``step``)."""

from __future__ import annotations

import re
from typing import Any

from moeckpt.formats.box import Box
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.reshard.dcp_source import Slot, whole

from ..common import MappingError, role_name
from ..unmapped import VALUES_KEY, read_values

TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
#: torchtitan's ``GroupedExperts``: name -> (plan name, block of ``gate_up_proj`` along dim 1, or None for
#: ``down_proj``). torchtitan keeps ``w1 [E, I, H]`` (gate), ``w3 [E, I, H]`` (up), ``w2 [E, H, I]`` (down) where the
#: plan fuses gate and up into ``gate_up_proj [E, 2I, H]``: w1 and w3 are its two blocks. 0.3 names first.
EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": ("mlp.experts.gate_up_proj", 0),
    "moe.routed_experts.inner_experts.w3_EFD": ("mlp.experts.gate_up_proj", 1),
    "moe.routed_experts.inner_experts.w2_EDF": ("mlp.experts.down_proj", None),
    "moe.experts.w1": ("mlp.experts.gate_up_proj", 0),
    "moe.experts.w3": ("mlp.experts.gate_up_proj", 1),
    "moe.experts.w2": ("mlp.experts.down_proj", None),
}
#: the auxiliary-loss-free balancing bias of a MoE layer (a buffer: no optimizer state).
BIAS = ("moe.expert_bias_E", "moe.expert_bias")
#: buffers older torchtitan saves that the model recomputes from its config (the RoPE table): dropped with a note.
DERIVED = ("freqs_cis", "rope.cache")
LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
OPT_RE = re.compile(r"^optimizer\.state\.(.+)\.(exp_avg|exp_avg_sq|step)$")


def split_names(dcp: DcpCheckpoint, notes: list[str]) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The checkpoint's model tensors, and its optimizer tensors by parameter (``{fqn: {"exp_avg": name, ...}}``);
    derived buffers are left out with a note."""
    derived = [n for n in dcp.tensors if n in DERIVED]
    if derived:
        notes.append(f"{', '.join(derived)} dropped: the RoPE table is recomputed from rope_theta")
    model: list[str] = []
    opt: dict[str, dict[str, str]] = {}
    for name in dcp.tensors:
        if name in DERIVED:
            continue
        m = OPT_RE.match(name)
        if m:
            opt.setdefault(m.group(1), {})[m.group(2)] = name
        else:
            model.append(name)
    return model, opt


def expert_slot(source: str, shape: tuple[int, ...], plan: str, block: int | None, role: str, inter: int) -> Slot:
    """The slot of a grouped-experts tensor: whole (``w2``), or block ``block`` of ``gate_up_proj`` (``w1``, ``w3``)."""
    target = role_name(plan, role)
    if block is None:
        return whole(source, shape, target)
    return Slot(source, Box.full(shape), target, (0, block * inter, 0))


def export_expert_names(layer: str, rest: str, shape: tuple[int, ...]) -> list[tuple[str, Box]] | None:
    """The torchtitan tensors plan tensor ``model.layers.<layer>.<rest>`` is written as, if it is an experts
    tensor (gate_up_proj -> w1 and w3, down_proj -> w2); None otherwise."""
    if rest == "mlp.experts.gate_up_proj":
        e, two_i, h = shape
        i = two_i // 2
        return [
            (f"layers.{layer}.moe.routed_experts.inner_experts.w1_EFD", Box((0, 0, 0), (e, i, h))),
            (f"layers.{layer}.moe.routed_experts.inner_experts.w3_EFD", Box((0, i, 0), (e, i, h))),
        ]
    if rest == "mlp.experts.down_proj":
        return [(f"layers.{layer}.moe.routed_experts.inner_experts.w2_EDF", Box.full(shape))]
    return None


def fused_qkv_parts(layer: int, cfg, param: str = "weight") -> list[tuple[str, Box, tuple[int, ...]]]:
    """torchtitan's fused ``wqkv`` weight (or bias) of a layer, per key/value group its query heads, one key head
    and one value head, as parts ``(plan tensor, box of it, offsets in wqkv)``: how its optimizer state, which
    torchtitan keeps fused where the model state is split, is exported."""
    hd, groups = cfg.head_dim, cfg.num_key_value_heads
    qpg = cfg.num_attention_heads // groups
    rest = (cfg.hidden_size,) if param == "weight" else ()
    zeros = (0,) * len(rest)
    pre = f"model.layers.{layer}.self_attn."
    parts = []
    for g in range(groups):
        base = g * (qpg + 2) * hd
        for part, n, at, lo in (
            ("q_proj", qpg * hd, g * qpg * hd, base),
            ("k_proj", hd, g * hd, base + qpg * hd),
            ("v_proj", hd, g * hd, base + (qpg + 1) * hd),
        ):
            parts.append((f"{pre}{part}.{param}", Box((at, *zeros), (n, *rest)), (lo, *zeros)))
    return parts


def refuse_unfilled(missing: list[str], twice: list[str], where: str) -> None:
    """The one-line refusal of a mapping that leaves plan tensors of ``--model`` unfilled or fills some twice."""
    if missing or twice:
        raise MappingError(
            f"{where}: "
            + (f"the checkpoint lacks {missing[:3]} of the --model config" if missing else f"{twice[:3]} given twice")
        )


def optimizer_notes(opt_keys: dict, with_optimizer: bool, dtype: str, notes: list[str]) -> None:
    """Say why a checkpoint's optimizer state is dropped (or that it has none)."""
    if opt_keys and not with_optimizer:
        notes.append(
            "optimizer state dropped: "
            + (
                f"parameters are {dtype} and the checkpoint has no fp32 master copy"
                if dtype != "float32"
                else "it does not hold exp_avg and exp_avg_sq for every parameter (not AdamW?)"
            )
        )
    elif not opt_keys:
        notes.append("no optimizer state in the checkpoint: the result holds parameters only")


def train_state(dcp: DcpCheckpoint, opt_keys: dict, fqns, with_optimizer: bool, notes: list[str]) -> dict[str, Any]:
    """The train state of the import: the non-tensor values kept for export, ``train_state.step`` as the step and
    AdamW's step count (one for all of ``fqns``) as the optimizer's."""
    out: dict[str, Any] = {}
    values = read_values(dcp, dcp.values, notes)
    if values:
        out[VALUES_KEY] = values
    step = values.get("train_state.step")
    if type(step) is int and step >= 0:
        out["step"] = step
    if with_optimizer:
        steps = {_scalar(dcp, opt_keys[n]["step"]) for n in fqns if "step" in opt_keys[n]}
        if len(steps) == 1 and type(next(iter(steps))) is int:
            out["optimizer"] = {"steps": next(iter(steps))}
    return out


def _scalar(dcp: DcpCheckpoint, name: str) -> int | None:
    t = dcp.read_tensor(name)
    if t.numel() != 1:
        return None
    v = float(t.reshape(()).item())
    return int(v) if v.is_integer() and v >= 0 else None
