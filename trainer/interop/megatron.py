"""Megatron-Core's GPTModel with MoE layers (``dist_checkpointing``, ``torch_dist`` backend) -> ``qwen3_moe``
(with q/k layer norms), ``mixtral`` (without) or ``deepseek_v3`` (multi-latent attention).

Megatron saves *sharded keys*, not module names: a layer's tensors are stacked along a leading layer dim
(``decoder.layers.self_attention.linear_qkv.weight [L, ...]``; per layer ``decoder.layers.<i>.`` when the layers
differ), local-spec layer norms are saved under the Transformer Engine names
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``), and:

* ``linear_qkv`` fuses Q, K and V *per query group*: for each of the ``G`` groups, its ``H/G`` query heads, then
  one key head, then one value head, ``head_dim`` rows each;
* ``linear_fc1`` stacks gate and up (``[2I, H]``: the gate rows first, then the up rows, whatever the TP degree:
  the swiglu sharded factory saves the TP halves at their global gate/up offsets);
* experts are ``mlp.experts.experts.linear_fc{1,2}.weight [L, E, ...]`` (SequentialMLP and the grouped GEMM
  experts save the same keys), or one key per global expert (``mlp.experts.<e>.linear_fc1.weight`` with
  ``singleton_local_shards``, ``mlp.experts.linear_fc1.weight<e>`` from TE grouped experts);
* the distributed optimizer in model space (``fully_reshardable``, ``fully_sharded_model_space``) and the plain
  optimizer save ``optimizer.state.{exp_avg,exp_avg_sq,param|fp32_param}.<model key>``, shaped as the model key.

Both plans hold these tensors under the same Hugging Face names (Qwen3-MoE adds ``q_norm``/``k_norm``), so one set
of slots serves both. A Mixtral import needs ``--model`` (its ``config.json``): without q/k layer norms no shape
tells the head dim, and the tensors must then cover the config's plan exactly. Megatron's router (top-k of the
logits, then a softmax over those, ``moe_router_pre_softmax=False``) is Mixtral's (a softmax, top-k, then the k
weights renormalized): the same weights.

A model with multi-latent attention (``MLATransformerConfig``; ``linear_kv_down_proj``) is a DeepSeek-V3 and needs
``--model`` too: ``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj`` (or ``linear_q_proj``),
``linear_kv_down_proj`` (its last ``qk_pos_emb_head_dim`` rows the shared rotary key), ``kv_layernorm``,
``linear_kv_up_proj`` are the plan's ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (``q_proj``),
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` row for row: Megatron's latent attention de-interleaves
the rotary dims as transformers' ``rope_interleave`` does. Dense layers' and shared experts' ``linear_fc1`` (gate
rows, then up rows) become ``gate_proj`` and ``up_proj``; the router's ``expert_bias`` is its
``e_score_correction_bias`` (no optimizer state), in the dtype Megatron keeps it in: float32, in a bf16 model too.

Every one of these becomes slots of the plan's tensors: no tensor is reshaped in memory. ``common.pt``
(Megatron's pickled common state: arguments, RNG, the optimizer step) is never read.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from moeckpt.formats.box import Box
from moeckpt.formats.dcp import DcpCheckpoint
from moeckpt.reshard.dcp_source import Slot
from moeckpt.reshard.tensors import logical_tensors

from ..models import ModelSpec
from ..models.deepseek_v3 import ARCH as DEEPSEEK_V3
from ..models.mixtral import ARCH as MIXTRAL
from ..models.qwen3_moe import ARCH as QWEN3_MOE
from .common import (
    Mapped,
    MappingError,
    check_covers,
    check_shapes,
    qkv_group_slots,
    qwen3_config,
    qwen3_tensors,
    role_name,
)

_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight",
}
#: DeepSeek-V3 (multi-latent attention): per-layer names, whole tensors.
_MLA_LAYER = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
}
#: DeepSeek-V3: a swiglu ``linear_fc1`` (gate rows, then up rows) -> the plan's separate gate and up.
_MLA_SPLIT = {
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.shared_experts.linear_fc1.weight": (
        "mlp.shared_experts.gate_proj.weight",
        "mlp.shared_experts.up_proj.weight",
    ),
}
_MLA_KEY = "self_attention.linear_kv_down_proj.weight"
_QKV = "self_attention.linear_qkv.weight"
_BIAS = "mlp.router.expert_bias"
_FUSED_EXPERTS = {
    "mlp.experts.experts.linear_fc1.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.experts.linear_fc2.weight": "mlp.experts.down_proj",
}
_ONE_EXPERT = [
    (re.compile(r"^mlp\.experts\.(\d+)\.linear_fc1\.weight$"), "mlp.experts.gate_up_proj"),
    (re.compile(r"^mlp\.experts\.(\d+)\.linear_fc2\.weight$"), "mlp.experts.down_proj"),
    (re.compile(r"^mlp\.experts\.linear_fc1\.weight(\d+)$"), "mlp.experts.gate_up_proj"),
    (re.compile(r"^mlp\.experts\.linear_fc2\.weight(\d+)$"), "mlp.experts.down_proj"),
]
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_OPT = re.compile(r"^optimizer\.state\.(exp_avg|exp_avg_sq|param|fp32_param)\.(.+)$")
#: Megatron's dist_checkpointing metadata file, naming the backend.
METADATA_JSON = "metadata.json"


def looks_like(names) -> bool:
    return "embedding.word_embeddings.weight" in names


class _Key:
    """A model key split into (layer or None for stacked, name within a layer) or a top-level name."""

    def __init__(self, key: str):
        self.key = key
        self.layer: int | None = None
        self.stacked = False
        self.rest = key
        m = _PER_LAYER.match(key)
        if m:
            self.layer, self.rest = int(m.group(1)), m.group(2)
            return
        m = _STACKED.match(key)
        if m:
            self.stacked, self.rest = True, m.group(1)

    @property
    def in_layer(self) -> bool:
        return self.stacked or self.layer is not None


def map_megatron(dcp: DcpCheckpoint, model: ModelSpec | None = None) -> Mapped:
    """A Megatron-Core GPT MoE checkpoint as a ``qwen3_moe`` (q/k layer norms) or ``mixtral`` model, optimizer
    state included."""
    where = dcp.location
    notes: list[str] = []
    _check_backend(dcp, notes)
    model_keys: list[str] = []
    opt: dict[str, Any] = {}
    for name in dcp.tensors:
        m = _OPT.match(name)
        if m:
            role = {"param": "master", "fp32_param": "master"}.get(m.group(1), m.group(1))
            opt.setdefault(m.group(2), {})[role] = name
        else:
            model_keys.append(name)
    keys = {n: _Key(n) for n in model_keys}
    mla = any(k.rest == _MLA_KEY for k in keys.values())
    table, split = (_MLA_LAYER, _MLA_SPLIT) if mla else (_LAYER, {})
    unknown = [n for n, k in keys.items() if not _known(k, table, split)]
    if unknown:
        raise MappingError(
            f"{where}: {len(unknown)} tensor(s) are not part of a Megatron GPT MoE model the "
            + ("deepseek_v3 plan has" if mla else "qwen3_moe and mixtral plans have")
            + f", e.g. {unknown[:3]}"
            + ("" if mla else " (dense MLP layers, shared experts and biases are not in them)")
            + "; use --mapping none"
        )
    if "embedding.word_embeddings.weight" not in keys:
        raise MappingError(f"{where}: no embedding.word_embeddings.weight: not a Megatron GPT checkpoint")
    for n, k in keys.items():
        if not mla and k.rest == _BIAS and torch.count_nonzero(dcp.read_tensor(n)).item():
            raise MappingError(
                f"{where}: {n} is not zero: the router was trained with expert biases, which neither Qwen3-MoE nor "
                "Mixtral computes"
            )
    dtype = dcp.tensors["embedding.word_embeddings.weight"].dtype
    qk_norms = any(k.rest == "self_attention.q_layernorm.weight" for k in keys.values())
    if mla:
        arch = DEEPSEEK_V3
        cfg, layers = _given_config(dcp, keys, model, where, arch, "with multi-latent attention", "the routing")
    elif qk_norms:
        shapes, layers = _shapes(dcp, keys, where)
        cfg = qwen3_config(shapes, "output_layer.weight" not in keys, model, where, notes)
        arch = QWEN3_MOE
    else:
        arch = MIXTRAL
        cfg, layers = _given_config(dcp, keys, model, where, arch, "without q/k layer norms", "its head dim")
    spec = ModelSpec(arch, cfg)
    untrained = spec.untrained()
    # the parameters: Qwen3-MoE and Mixtral drop the (zero) expert bias, DeepSeek-V3 keeps it as its correction bias
    params = [n for n, k in keys.items() if mla or k.rest != _BIAS]
    real = [n for n in params if keys[n].rest != _BIAS]  # what an optimizer steps
    have = {r for n in real for r in opt.get(n, {})}
    full = {"exp_avg", "exp_avg_sq"} | ({"master"} if dtype != "float32" else set())
    with_optimizer = all(full <= set(opt.get(n, {})) for n in real)
    if opt and not with_optimizer:
        notes.append(
            f"optimizer state dropped: it does not hold {', '.join(sorted(full))} for every parameter "
            f"(found {', '.join(sorted(have)) or 'none'})"
        )
    elif not opt:
        notes.append("no optimizer state in the checkpoint: the result holds parameters only")
    if with_optimizer:
        notes.append(
            "the AdamW step count is in Megatron's common.pt, which moeckpt does not unpickle: bias "
            "correction restarts from step 0 (export-dcp --mapping megatron --megatron-step N writes it back)"
        )
    roles = ["param"] + (sorted(full) if with_optimizer else [])
    if arch == QWEN3_MOE:
        tensors = qwen3_tensors(cfg, dtype, with_optimizer)
    else:
        tensors = logical_tensors(
            spec.param_specs(),
            param_dtype=dtype,
            optimizer_roles=lambda name: () if name in untrained else tuple(roles[1:]),
        )
    if with_optimizer and dtype == "float32" and any("master" in opt.get(n, {}) for n in real):
        notes.append("fp32 master copies dropped: the parameters are fp32 and are their own master")
    slots: list[Slot] = []
    for n in params:
        for role in roles if n in real else ["param"]:
            src = n if role == "param" else opt[n][role]
            found = _slots(keys[n], src, dcp.tensors[src].shape, role, cfg, layers, table, split)
            if n not in real:
                # the router's expert_bias: Megatron keeps it in float32 whatever the parameters' dtype
                # (TopKRouter._maintain_float32_expert_bias), and so does the result, rather than round it
                for slot in found:
                    tensors[slot.target] = dataclasses.replace(tensors[slot.target], dtype=dcp.tensors[src].dtype)
            slots += found
    check_shapes(tensors, slots, dcp, where)
    check_covers(tensors, slots, dcp, where)
    return Mapped(
        model={"arch": arch, "config": cfg.to_json()}, tensors=tensors, slots=slots, notes=notes, train_state={}
    )


def _given_config(
    dcp: DcpCheckpoint, keys: dict[str, _Key], model: ModelSpec | None, where: str, arch: str, kind: str, what: str
):
    """The ``--model`` config of a family the shapes cannot describe (``arch``), and its layer count."""
    if model is None or model.arch != arch:
        raise MappingError(
            f"{where}: a Megatron GPT MoE checkpoint {kind} maps onto {arch}, which needs --model with the model's "
            f"{arch} config.json"
            + (f" (got a {model.arch} model)" if model is not None else "")
            + f": no tensor shape tells {what}, top-k or RoPE theta"
        )
    cfg = model.config
    stacked = [dcp.tensors[n].shape[0] for n, k in keys.items() if k.stacked]
    layers = {1 + k.layer for k in keys.values() if k.layer is not None}
    found = stacked[0] if stacked else max(layers, default=0)
    if found != cfg.num_hidden_layers:
        raise MappingError(
            f"{where}: the checkpoint has {found} layers but --model gives num_hidden_layers={cfg.num_hidden_layers}"
        )
    return cfg, found


def _check_backend(dcp: DcpCheckpoint, notes: list[str]) -> None:
    import json

    if not dcp.storage.exists(METADATA_JSON):
        notes.append(f"no {METADATA_JSON}: read as a plain torch_dist checkpoint")
        return
    try:
        doc = json.loads(dcp.storage.read_bytes(METADATA_JSON))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MappingError(f"{dcp.storage.path(METADATA_JSON)}: not valid JSON ({e})") from None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    if backend != "torch_dist":
        raise MappingError(
            f"{dcp.storage.path(METADATA_JSON)}: sharded_backend is {backend!r}; moeckpt reads the "
            "torch_dist backend (re-save with --ckpt-format torch_dist)"
        )


def _known(k: _Key, table: dict[str, str], split: dict) -> bool:
    if not k.in_layer:
        return k.key in _TOP
    return (
        k.rest in table
        or k.rest in split
        or (table is _LAYER and k.rest in (_QKV, _BIAS))
        or k.rest in _FUSED_EXPERTS
        or any(p.match(k.rest) for p, _ in _ONE_EXPERT)
    )


def _region(
    shape: tuple[int, ...],
    stacked: bool,
    layer: int,
    inner_lo: tuple[int, ...] = (),
    inner_shape: tuple[int, ...] | None = None,
) -> Box:
    inner = shape[1:] if stacked else shape
    lo = inner_lo + (0,) * (len(inner) - len(inner_lo))
    size = inner_shape if inner_shape is not None else tuple(s - o for s, o in zip(inner, lo))
    return Box(((layer,) if stacked else ()) + lo, ((1,) if stacked else ()) + size)


def _layer_of(k: _Key) -> int:
    """The layer of a per-layer key that names one (the unstacked layout's ``layers.N.``)."""
    if k.layer is None:
        raise MappingError(f"{k.key}: a per-layer tensor with no layer number")
    return k.layer


def _slots(
    k: _Key, src: str, shape: tuple[int, ...], role: str, cfg, layers: int, table: dict[str, str], split: dict
) -> list[Slot]:
    if not k.in_layer:
        target = role_name(_TOP[k.key], role)
        return [Slot(src, Box.full(shape), target, (0,) * len(shape))]
    out = []
    for layer in range(layers) if k.stacked else [_layer_of(k)]:
        drop = 1 if k.stacked else 0
        pre = f"model.layers.{layer}."
        if k.rest in table:
            out.append(
                Slot(
                    src,
                    _region(shape, k.stacked, layer),
                    role_name(pre + table[k.rest], role),
                    (0,) * (len(shape) - drop),
                    drop,
                )
            )
        elif k.rest in split:  # gate rows, then up rows
            rows, cols = (shape[1:] if k.stacked else shape)[-2:]
            for j, part in enumerate(split[k.rest]):
                region = _region(shape, k.stacked, layer, (j * (rows // 2), 0), (rows // 2, cols))
                out.append(Slot(src, region, role_name(pre + part, role), (0, 0), drop))
        elif k.rest == _QKV:
            out += qkv_group_slots(src, shape, layer if k.stacked else None, pre, role, cfg)
        elif k.rest in _FUSED_EXPERTS:
            out.append(
                Slot(
                    src,
                    _region(shape, k.stacked, layer),
                    role_name(pre + _FUSED_EXPERTS[k.rest], role),
                    (0, 0, 0),
                    drop,
                )
            )
        else:
            for pattern, plan in _ONE_EXPERT:
                m = pattern.match(k.rest)
                if m:
                    out.append(
                        Slot(
                            src,
                            _region(shape, k.stacked, layer),
                            role_name(pre + plan, role),
                            (int(m.group(1)), 0, 0),
                            drop,
                            lift=1,
                        )
                    )
    return out


def _shapes(dcp: DcpCheckpoint, keys: dict[str, _Key], where: str) -> tuple[dict[str, int], int]:
    def find(rest: str) -> tuple[_Key, tuple[int, ...]] | None:
        for n, k in keys.items():
            if k.in_layer and k.rest == rest and (k.stacked or k.layer == 0):
                return k, dcp.tensors[n].shape
        return None

    vocab, hidden = dcp.tensors["embedding.word_embeddings.weight"].shape
    qkv, proj, qn = find(_QKV), find("self_attention.linear_proj.weight"), find("self_attention.q_layernorm.weight")
    if qkv is None or proj is None or qn is None:
        raise MappingError(
            f"{where}: no linear_qkv, linear_proj and q_layernorm weights: not a Qwen3-style Megatron "
            "GPT model (q/k layer norms are needed)"
        )
    stacked = qkv[0].stacked
    layers = qkv[1][0] if stacked else 1 + max(k.layer for k in keys.values() if k.layer is not None)
    inner = (lambda s: s[1:]) if stacked else (lambda s: s)
    head_dim = inner(qn[1])[0]
    heads = inner(proj[1])[1] // head_dim
    rows = inner(qkv[1])[0] // head_dim
    if (rows - heads) % 2 or rows <= heads:
        raise MappingError(
            f"{where}: linear_qkv has {rows} heads of rows for {heads} query heads: not fused per query group"
        )
    fc2 = find("mlp.experts.experts.linear_fc2.weight")
    if fc2 is not None:
        experts, _h, inter = inner(fc2[1])
    else:
        ids = sorted(
            {
                int(m.group(1))
                for k in keys.values()
                for p, plan in _ONE_EXPERT
                if plan.endswith("down_proj") and (m := p.match(k.rest))
            }
        )
        one = next(
            (
                dcp.tensors[n].shape
                for n, k in keys.items()
                if any(p.match(k.rest) for p, plan in _ONE_EXPERT if plan.endswith("down_proj"))
            ),
            None,
        )
        if not ids or one is None:
            raise MappingError(f"{where}: no expert weights (linear_fc2): not a MoE model")
        experts, inter = len(ids), inner(one)[-1]
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "head_dim": head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": (rows - heads) // 2,
        "num_experts": experts,
        "moe_intermediate_size": inter,
    }, layers
