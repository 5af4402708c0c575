"""The blocks MoE transformer plans are made of, each with its tensor-parallel split, under Hugging Face names.

Every family folder builds its ``param_specs`` from these, so that a block splits the same way in every family:

* **column-parallel** (split along dim 0, a rank owns whole output heads or channels): q/k/v projections and
  their biases, MLA's ``q_b_proj`` and ``kv_b_proj``, dense and shared-expert gate/up projections, per-head
  attention sinks, and norms over the full q or k width (OLMoE), whose channels follow their heads;
* **row-parallel** (split along dim 1): output projections and dense down projections (their biases are added
  once, after the sum, so they are replicated);
* **replicated**: norms of one head or of the hidden size, routers and their biases, the routing correction bias,
  the shared-expert gate, and MLA's low-rank down projections (``q_a_proj``, ``kv_a_proj_with_mqa``), which every
  head reads;
* **experts**: split over expert-parallel ranks along dim 0 (global expert ``e`` stays expert ``e``) and over TP
  ranks along their intermediate dimension, gate and up as two blocks of the fused ``[E, 2I, H]`` tensor;
* **vocabulary-parallel**: the embedding and an untied output head, along the vocabulary.

``matrix=`` marks the hidden 2-D matrices an orthogonalizing optimizer (Muon) would step whole, as in the trainer's
plans; embeddings, heads, routers and everything not a matrix are element-wise.
"""

from __future__ import annotations

from moeckpt.reshard.rules import ShardingRule, TpSplit
from moeckpt.reshard.tensors import Matrices, ParamSpec

MATRIX = Matrices()


def column(name: str, shape: tuple[int, ...], *, matrix: bool = False, init: str = "normal") -> ParamSpec:
    """A tensor split along dim 0 under TP (whole output heads or channels per rank)."""
    return ParamSpec(
        name=name, shape=shape, rule=ShardingRule(tp=TpSplit(dim=0)), matrix=MATRIX if matrix else None, init=init
    )


def row(name: str, shape: tuple[int, int]) -> ParamSpec:
    """A 2-D weight split along dim 1 under TP (its input channels), a hidden matrix."""
    return ParamSpec(name=name, shape=shape, rule=ShardingRule(tp=TpSplit(dim=1)), matrix=MATRIX)


def replicated(name: str, shape: tuple[int, ...], *, init: str = "normal", matrix: bool = False) -> ParamSpec:
    """A tensor every TP and EP rank holds whole."""
    return ParamSpec(name=name, shape=shape, init=init, matrix=MATRIX if matrix else None)


def norm(name: str, size: int) -> ParamSpec:
    """An RMSNorm (or LayerNorm) weight, replicated."""
    return ParamSpec(name=name, shape=(size,), init="ones")


def embedding(vocab_size: int, hidden: int) -> ParamSpec:
    return column("model.embed_tokens.weight", (vocab_size, hidden))


def head(vocab_size: int, hidden: int, tied: bool) -> list[ParamSpec]:
    """The output head, unless it is the embedding (tied)."""
    return [] if tied else [column("lm_head.weight", (vocab_size, hidden))]


def gqa_attention(
    prefix: str,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: str | None = None,
    sinks: bool = False,
) -> list[ParamSpec]:
    """Grouped-query attention under ``prefix`` (``model.layers.L.self_attn.``): q, k, v, o and their options.

    ``qk_norm``: ``"head"`` for one norm of ``head_dim`` applied to every head (replicated), ``"full"`` for a norm
    over the whole q and k width (column-parallel with its heads). ``sinks``: one learned logit per query head.
    """
    q, kv = heads * head_dim, kv_heads * head_dim
    out = [
        column(prefix + "q_proj.weight", (q, hidden), matrix=True),
        column(prefix + "k_proj.weight", (kv, hidden), matrix=True),
        column(prefix + "v_proj.weight", (kv, hidden), matrix=True),
        row(prefix + "o_proj.weight", (hidden, q)),
    ]
    if qkv_bias:
        out[3:3] = [
            column(prefix + "q_proj.bias", (q,), init="zeros"),
            column(prefix + "k_proj.bias", (kv,), init="zeros"),
            column(prefix + "v_proj.bias", (kv,), init="zeros"),
        ]
    if o_bias:
        out.append(replicated(prefix + "o_proj.bias", (hidden,), init="zeros"))
    if qk_norm == "head":
        out += [norm(prefix + "q_norm.weight", head_dim), norm(prefix + "k_norm.weight", head_dim)]
    elif qk_norm == "full":
        out += [
            column(prefix + "q_norm.weight", (q,), init="ones"),
            column(prefix + "k_norm.weight", (kv,), init="ones"),
        ]
    elif qk_norm is not None:
        raise ValueError(f"qk_norm={qk_norm!r}: expected 'head', 'full' or None")
    if sinks:
        out.append(column(prefix + "sinks", (heads,), init="zeros"))
    return out


def dense_mlp(prefix: str, hidden: int, intermediate: int) -> list[ParamSpec]:
    """A SwiGLU MLP under ``prefix`` (``...mlp.`` or ``...mlp.shared_experts.``): gate/up by column, down by row."""
    return [
        column(prefix + "gate_proj.weight", (intermediate, hidden), matrix=True),
        column(prefix + "up_proj.weight", (intermediate, hidden), matrix=True),
        row(prefix + "down_proj.weight", (hidden, intermediate)),
    ]


def experts(prefix: str, num_experts: int, hidden: int, intermediate: int) -> list[ParamSpec]:
    """Fused SwiGLU experts under ``prefix`` (``...mlp.experts.``), transformers 5's layout: ``gate_up_proj``
    ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj`` ``[E, H, I]``."""
    i = intermediate
    return [
        ParamSpec(
            name=prefix + "gate_up_proj",
            shape=(num_experts, 2 * i, hidden),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=1, blocks=(i, i))),
            matrix=Matrices(batch_dim=0, blocks=(i, i)),
        ),
        ParamSpec(
            name=prefix + "down_proj",
            shape=(num_experts, hidden, i),
            rule=ShardingRule(expert_dim=0, tp=TpSplit(dim=2)),
            matrix=Matrices(batch_dim=0),
        ),
    ]


def layer_norms(prefix: str, hidden: int) -> list[ParamSpec]:
    """The two pre-norms of a decoder layer."""
    return [norm(prefix + "input_layernorm.weight", hidden), norm(prefix + "post_attention_layernorm.weight", hidden)]
