"""Random small MoE models and layouts for the resharder's property tests (Hypothesis strategies)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.save import save_full_tensors
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.init_values import initial_value
from moeckpt.trainer.models import ModelSpec
from moeckpt.trainer.models.qwen3_moe.config import Qwen3MoeConfig
from moeckpt.trainer.models.zaya.config import ZayaConfig


@st.composite
def models(draw) -> ModelSpec:
    """A tiny ZAYA or Qwen3-MoE with random sizes (heads, experts, widths, vocabulary)."""
    kv = draw(st.sampled_from([1, 2, 4]))
    common = {
        "vocab_size": draw(st.sampled_from([8, 12, 16, 24])),
        "hidden_size": draw(st.sampled_from([4, 8, 12])),
        "num_hidden_layers": draw(st.integers(1, 2)),
        "num_key_value_heads": kv,
        "num_attention_heads": kv * draw(st.sampled_from([1, 2])),
        "head_dim": draw(st.sampled_from([2, 4])),
        "moe_intermediate_size": draw(st.sampled_from([4, 8, 12])),
        "num_experts": draw(st.sampled_from([2, 4, 8])),
    }
    if draw(st.booleans()):
        return ModelSpec("zaya", ZayaConfig(**common, router_hidden_size=draw(st.sampled_from([2, 4]))))
    return ModelSpec("qwen3_moe", Qwen3MoeConfig(**common, num_experts_per_tok=1))


@st.composite
def layouts(draw, spec: ModelSpec, max_world: int = 8) -> Layout:
    """A layout the model can take, world size at most ``max_world``."""
    options = []
    for tp in (1, 2, 4):
        for ep in (1, 2, 4, 8):
            for dp in range(ep, max_world // tp + 1, ep):
                try:
                    spec.check_layout(tp, ep)
                except LayoutError:
                    continue
                options.append(Layout(tp=tp, ep=ep, dp=dp))
    return draw(st.sampled_from(options))


def checkpoint_values(spec: ModelSpec, *, dtype: str = "bfloat16", seed: int = 0):
    """The logical tensors of a model with optimizer state, and their full values (distinct elements)."""
    tensors = logical_tensors(spec.param_specs(), param_dtype=dtype, with_optimizer=True)
    values = {}
    for name, e in tensors.items():
        full = initial_value(e, seed=seed, std=1.0)
        if e.role == "param":  # make every element distinct so a misplaced element cannot go unnoticed
            full = (full.float() + torch.arange(e.numel, dtype=torch.float32).reshape(e.shape) * 1e-3).to(full.dtype)
        values[name] = full
    return tensors, values


def save_model(location: str, spec: ModelSpec, layout: Layout, *, backend: str = "safetensors", seed: int = 0):
    tensors, values = checkpoint_values(spec, seed=seed)
    save_full_tensors(
        location,
        tensors=tensors,
        layout=layout,
        values=lambda e: values[e.name],
        model=spec.to_json(),
        backend=backend,
        step=11,
        train_state={"step": 11, "consumed_samples": 352, "seed": seed},
    )
    return tensors, values
