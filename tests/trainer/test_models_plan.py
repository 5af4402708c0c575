"""The model modules hold exactly the tensors their sharding plans list, whole and as every rank's shard."""

from __future__ import annotations

import pytest
import torch

from moeckpt.formats.errors import LayoutError
from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import model_parallel_boxes
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.hf_export import hf_module
from moeckpt.trainer.models import presets
from moeckpt.trainer.models.layers import Shard, build_model

transformers = pytest.importorskip("transformers")

PRESETS = presets()
#: presets too large to materialise on a CPU test machine: compared on the meta device only.
HUGE = {
    "zaya1-8b",
    "qwen3moe-30b-a3b",
    "zaya-small",
    "deepseekv3-671b",
    "mixtral-8x7b",
    "olmoe-1b-7b",
    "gptoss-20b",
    "qwen2moe-a2.7b",
    "glm4moe-air",
}
#: presets of the architectures the bundled trainer runs (the others are checkpoint formats, with no module).
TRAINED = sorted(name for name, spec in PRESETS.items() if spec.trainable)


def hf_config(spec):
    """transformers' config object for a model, from the ``config.json`` our export writes."""
    doc = dict(hf_module(spec).to_hf_config(spec.config))
    return transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)


def _module_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def _plan_shapes(spec) -> dict[str, tuple[int, ...]]:
    return {p.name: tuple(p.shape) for p in spec.param_specs()}


@pytest.mark.parametrize("preset", TRAINED)
def test_module_state_dict_is_the_plan(preset):
    spec = PRESETS[preset]
    with torch.device("meta"):
        model = build_model(spec)
    assert list(_module_shapes(model).items()) == list(_plan_shapes(spec).items())


#: transformers builds DeepSeek-V3's 671B shape (61 layers of 256 experts) for tens of seconds, even on meta.
_SLOW_TO_BUILD = {"deepseekv3-671b"}


@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p in _SLOW_TO_BUILD else p for p in sorted(PRESETS)]
)
def test_plan_is_transformers_state_dict(preset):
    spec = PRESETS[preset]
    cfg = hf_config(spec)
    cls = getattr(transformers, cfg.architectures[0])
    if preset in HUGE:
        with torch.device("meta"):
            hf = cls(cfg)
    else:
        hf = cls(cfg)
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if spec.config.tie_word_embeddings:
        # transformers lists the tied head under its own name too; it is the embedding, not a tensor of its own.
        assert hf_shapes.pop("lm_head.weight") == hf_shapes["model.embed_tokens.weight"]
    assert hf_shapes == _plan_shapes(spec)


@pytest.mark.parametrize("preset", TRAINED)
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2), (2, 4)])
def test_shard_shapes_follow_the_sharding_rules(preset, tp, ep):
    """Each rank's module tensors have the shape of the concatenated boxes the plan's rules give that rank."""
    spec = PRESETS[preset]
    try:
        spec.check_layout(tp, ep)
    except LayoutError:
        pytest.skip(f"{preset} cannot take tp={tp} ep={ep}")
    layout = Layout(tp=tp, ep=ep, dp=ep)  # dp = ep: every rank holds a distinct (tp_rank, ep_rank) shard
    entries = logical_tensors(spec.param_specs())
    for rank in range(layout.world):
        shard = Shard.for_rank(layout, rank)
        tp_rank, ep_rank = shard.tp_rank, shard.ep_rank
        with torch.device("meta"):
            model = build_model(spec, shard)
        got = _module_shapes(model)
        assert set(got) == set(entries)
        for name, entry in entries.items():
            boxes = model_parallel_boxes(entry, layout, tp_rank, ep_rank)
            tp_dim = entry.sharding["tp"]["dim"] if "tp" in entry.sharding else 0
            want = list(boxes[0].shape)
            want[tp_dim] = sum(b.shape[tp_dim] for b in boxes)
            assert got[name] == tuple(want), (name, tp_rank, ep_rank)


def test_zaya_value_halves_map_to_heads():
    """With 2 KV heads and tp=2, rank 0 computes the whole current value half and rank 1 the whole delayed half."""
    spec = PRESETS["zaya-tiny"]
    half = spec.config.num_key_value_heads * spec.config.head_dim // 2
    shapes = []
    for rank in range(2):
        with torch.device("meta"):
            model = build_model(spec, Shard(tp=2, tp_rank=rank))
        cca = model.model.layers[0].self_attn.qkv_proj
        shapes.append((cca.v_proj_current.weight.shape[0], cca.v_proj_delayed.weight.shape[0]))
    assert shapes == [(half, 0), (0, half)]


def test_layout_the_model_cannot_take_is_refused():
    spec = PRESETS["zaya-tiny"]
    with pytest.raises(LayoutError, match="num_key_value_heads"):
        build_model(spec, Shard(tp=4, tp_rank=0))
    with pytest.raises(LayoutError, match="num_experts"):
        build_model(spec, Shard(ep=3, ep_rank=0))


def test_resolve_model_reads_a_hugging_face_config_json(tmp_path):
    """A transformers config.json goes through the architecture's HF mapping (nested rope parameters included)."""
    import json

    from transformers import ZayaConfig as HfZayaConfig

    from moeckpt.trainer.models import resolve_model

    hf = HfZayaConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        router_hidden_size=16,
    )
    hf.rope_parameters["hybrid"]["rope_theta"] = 12345.0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf.to_dict()))
    spec = resolve_model(str(path))
    assert spec.arch == "zaya"
    assert spec.config.num_hidden_layers == 3 and spec.config.vocab_size == 512
    assert spec.config.rope_theta == 12345.0
