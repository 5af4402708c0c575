"""The DeepSeek-V3 constants the trainer computes with that shape no tensor (routing, norms, RoPE), read from the
config's ``hf_config`` with transformers' defaults and checked once, before a model is built.

A checkpoint-only family keeps these fields verbatim and never looks at them; running the model needs each one
to mean what transformers makes of it, so a value the module does not implement (YaRN RoPE, another activation,
key/value heads other than the query heads) is refused here rather than silently computed differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeckpt.formats.errors import MoeckptError

from .config import DeepseekV3Config


class UnsupportedDeepseekConfigError(MoeckptError, ValueError):
    """A DeepSeek-V3 config the bundled trainer cannot run as transformers would (the message names the field)."""


@dataclass(frozen=True)
class Runtime:
    """What :mod:`.model` computes with besides the tensor shapes."""

    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_interleave: bool


def runtime(cfg: DeepseekV3Config) -> Runtime:
    """The checked constants of ``cfg``; raises :class:`UnsupportedDeepseekConfigError` naming the first bad one."""
    rope = cfg.hf("rope_parameters", {}) or {}
    scaling = cfg.hf("rope_scaling", None)
    theta = rope.get("rope_theta", cfg.hf("rope_theta", 10000.0)) if isinstance(rope, dict) else None
    kinds = [k.get("rope_type") or k.get("type") for k in (rope, scaling) if isinstance(k, dict)]
    out = Runtime(
        num_experts_per_tok=cfg.hf("num_experts_per_tok", 8),
        n_group=cfg.hf("n_group", 8),
        topk_group=cfg.hf("topk_group", 4),
        norm_topk_prob=cfg.hf("norm_topk_prob", True),
        routed_scaling_factor=cfg.hf("routed_scaling_factor", 2.5),
        rms_norm_eps=cfg.hf("rms_norm_eps", 1e-6),
        rope_theta=theta,  # type: ignore[arg-type]  # checked below
        rope_interleave=cfg.hf("rope_interleave", True),
    )
    _check(cfg, out, [k for k in kinds if k not in (None, "default")] or ([scaling] if _odd(scaling) else []))
    return out


def _odd(scaling) -> bool:
    return scaling is not None and not isinstance(scaling, dict)


def _refuse(field: str, value, why: str) -> None:
    raise UnsupportedDeepseekConfigError(
        f"deepseek_v3 config: {field}={value!r} {why}; fix it in the model config (hf_config) to train this model"
    )


def _check(cfg: DeepseekV3Config, rt: Runtime, scaled: list) -> None:
    e = cfg.n_routed_experts
    for name in ("num_experts_per_tok", "n_group", "topk_group"):
        v = getattr(rt, name)
        if type(v) is not int or v < 1:
            _refuse(name, v, "must be a positive integer")
    if e % rt.n_group or e // rt.n_group < 2:
        # transformers scores a group by the sum of its two best experts, so a group needs two
        _refuse("n_group", rt.n_group, f"must divide n_routed_experts={e} into groups of at least 2 experts")
    if rt.topk_group > rt.n_group:
        _refuse("topk_group", rt.topk_group, f"must be at most n_group={rt.n_group}")
    if rt.num_experts_per_tok > rt.topk_group * (e // rt.n_group):
        _refuse(
            "num_experts_per_tok",
            rt.num_experts_per_tok,
            f"must be at most the experts of topk_group={rt.topk_group} groups ({rt.topk_group * (e // rt.n_group)})",
        )
    for name in ("norm_topk_prob", "rope_interleave"):
        if type(getattr(rt, name)) is not bool:
            _refuse(name, getattr(rt, name), "must be true or false")
    for name, low in (("routed_scaling_factor", 0.0), ("rms_norm_eps", 0.0), ("rope_theta", 0.0)):
        v = getattr(rt, name)
        if type(v) not in (int, float) or not math.isfinite(v) or v <= low:
            _refuse(name, v, "must be a finite number > 0")
    if scaled:
        _refuse("rope scaling", scaled[0], "is not implemented by the trainer (plain RoPE only, no YaRN)")
    act = cfg.hf("hidden_act", "silu")
    if act != "silu":
        _refuse("hidden_act", act, "is not implemented by the trainer (SwiGLU with silu only)")
    kv = cfg.hf("num_key_value_heads", cfg.num_attention_heads)
    if kv != cfg.num_attention_heads:
        _refuse("num_key_value_heads", kv, f"must equal num_attention_heads={cfg.num_attention_heads} (MLA)")
    dropout = cfg.hf("attention_dropout", 0.0)
    if dropout != 0:
        _refuse("attention_dropout", dropout, "is not implemented by the trainer (no dropout)")
    if cfg.mtp_tensors:
        _refuse(
            "mtp_tensors",
            f"{len(cfg.mtp_tensors)} tensors",
            "are multi-token-prediction layers the trainer does not run (transformers ignores them too)",
        )
