"""Workers (run under torchrun, gloo on CPU) that write real torch DCP checkpoints for the import-dcp tests.

``torchtitan OUT``: torchtitan's own tiny Qwen3-MoE, parallelized by torchtitan's ``parallelize_qwen3`` (FSDP2 over
2 ranks x TP 2, EP 2: DTensors with ``_StridedShard`` placements), two AdamW steps on random gradients (flex
attention has no CPU backward, so no real loss), then ``dcp.save`` of the state torchtitan's checkpointer saves:
the model's state dict at the top level, ``optimizer`` flattened by parameter (torchtitan's own
``get_flat_optim_state_dict``), ``train_state`` and ``lr_scheduler``.

``torchtitan-dsv3 OUT``: the same with torchtitan's own tiny DeepSeek-V3 (MLA with q_lora, one dense layer then a
MoE layer of a shared expert and sigmoid-routed experts with group-limited top-k and a trained ``expert_bias_E``),
parallelized by ``parallelize_deepseekv3`` over 2 ranks (TP 2, EP 2 borrowing the TP ranks).

``megatron OUT``: Megatron-Core's tiny GPTModel with MoE layers, saved by its own ``dist_checkpointing.save``;
``megatron-mixtral OUT``: the same model as Mixtral (no q/k layer norms); ``megatron-dsv3 OUT``: Megatron's GPTModel
as DeepSeek-V3 (multi-latent attention); ``megatron-families OUT``: both, in one process.

``titan-names OUT``: the same names, shapes and DTensor shardings without torchtitan installed: a Qwen3-MoE from
moeckpt's plan renamed to torchtitan's names, sharded over a 2 x 2 mesh, with AdamW moments, through dcp.save.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

TINY = {
    "dim": 64,
    "head_dim": 16,
    "n_layers": 2,
    "vocab": 256,
    "n_heads": 4,
    "n_kv_heads": 2,
    "moe_hidden": 32,
    "experts": 4,
    "top_k": 2,
}


def torchtitan_config():
    """torchtitan's Qwen3-MoE config at the tiny size, built with torchtitan's own builders."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    t = TINY
    return Qwen3Model.Config(
        vocab_size=t["vocab"],
        dim=t["dim"],
        norm=_qwen3_norm(t["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=t["vocab"], embedding_dim=t["dim"], param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=t["dim"], out_features=t["vocab"], param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=t["n_layers"],
            dim=t["dim"],
            n_heads=t["n_heads"],
            n_kv_heads=t["n_kv_heads"],
            head_dim=t["head_dim"],
            moe_hidden_dim=t["moe_hidden"],
            num_experts=t["experts"],
            top_k=t["top_k"],
            attn_backend="flex",
            rope=CosSinRoPE.Config(dim=t["head_dim"], max_seq_len=128, theta=1e6),
            moe_comm_backend="standard",
        ),
    )


def hf_config_json() -> dict:
    """The moeckpt model config of the tiny model (what --model is given)."""
    t = TINY
    return {
        "arch": "qwen3_moe",
        "config": {
            "vocab_size": t["vocab"],
            "hidden_size": t["dim"],
            "num_hidden_layers": t["n_layers"],
            "num_attention_heads": t["n_heads"],
            "num_key_value_heads": t["n_kv_heads"],
            "head_dim": t["head_dim"],
            "moe_intermediate_size": t["moe_hidden"],
            "num_experts": t["experts"],
            "num_experts_per_tok": t["top_k"],
            "max_position_embeddings": 128,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
        },
    }


#: the tiny DeepSeek-V3: q_lora (wq_a/wq_b), a rope part of the keys shared by the heads (wkv_a's last rows), one
#: dense layer, then MoE layers with a shared expert and sigmoid routing over 2 groups of 2 experts.
TINY_DSV3 = {
    "dim": 64,
    "n_layers": 2,
    "n_dense_layers": 1,
    "vocab": 256,
    "n_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "dense_hidden": 96,
    "moe_hidden": 32,
    "experts": 4,
    "shared_experts": 1,
    "top_k": 2,
    "groups": 2,
    "limited_groups": 1,
    "route_scale": 2.5,
    "rope_theta": 10000.0,
}


def torchtitan_dsv3_config():
    """torchtitan's DeepSeek-V3 config at the tiny size, built with torchtitan's own builders (no YaRN: the
    default RoPE, whose softmax scale is the plain ``qk_head_dim ** -0.5`` on both sides)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
    )

    t = TINY_DSV3
    layers = _build_dsv3_layers(
        n_layers=t["n_layers"],
        n_dense_layers=t["n_dense_layers"],
        dim=t["dim"],
        n_heads=t["n_heads"],
        q_lora_rank=t["q_lora_rank"],
        kv_lora_rank=t["kv_lora_rank"],
        qk_nope_head_dim=t["qk_nope_head_dim"],
        qk_rope_head_dim=t["qk_rope_head_dim"],
        v_head_dim=t["v_head_dim"],
        mscale=1.0,
        dense_hidden_dim=t["dense_hidden"],
        moe_hidden_dim=t["moe_hidden"],
        num_experts=t["experts"],
        num_shared_experts=t["shared_experts"],
        router_top_k=t["top_k"],
        router_score_func="sigmoid",
        router_num_expert_groups=t["groups"],
        router_num_limited_groups=t["limited_groups"],
        router_route_scale=t["route_scale"],
        router_route_norm=True,
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=t["qk_rope_head_dim"], max_seq_len=128, theta=t["rope_theta"]),
    )
    return DeepSeekV3Model.Config(
        vocab_size=t["vocab"],
        dim=t["dim"],
        tok_embeddings=Embedding.Config(num_embeddings=t["vocab"], embedding_dim=t["dim"], param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=t["dim"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=t["dim"], out_features=t["vocab"], param_init=_LINEAR_INIT),
        layers=layers,
        mtp_layers=[],
    )


def hf_dsv3_config_json() -> dict:
    """The Hugging Face ``config.json`` of the tiny DeepSeek-V3 (what ``--model`` is given): the routing fields no
    tensor shape tells, and torchtitan's RMSNorm eps (1e-5, where transformers defaults to 1e-6)."""
    t = TINY_DSV3
    return {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": t["vocab"],
        "hidden_size": t["dim"],
        "intermediate_size": t["dense_hidden"],
        "moe_intermediate_size": t["moe_hidden"],
        "num_hidden_layers": t["n_layers"],
        "num_attention_heads": t["n_heads"],
        "num_key_value_heads": t["n_heads"],
        "n_shared_experts": t["shared_experts"],
        "n_routed_experts": t["experts"],
        "kv_lora_rank": t["kv_lora_rank"],
        "q_lora_rank": t["q_lora_rank"],
        "qk_rope_head_dim": t["qk_rope_head_dim"],
        "qk_nope_head_dim": t["qk_nope_head_dim"],
        "v_head_dim": t["v_head_dim"],
        "first_k_dense_replace": t["n_dense_layers"],
        "num_experts_per_tok": t["top_k"],
        "n_group": t["groups"],
        "topk_group": t["limited_groups"],
        "routed_scaling_factor": t["route_scale"],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": t["rope_theta"],
        "rope_interleave": True,
        "max_position_embeddings": 128,
        "tie_word_embeddings": False,
    }


def torchtitan_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    with torch.no_grad():
        return model(tokens, positions, model.get_attention_masks(positions))


def _same_everywhere(like, full: torch.Tensor):
    """``full`` (equal on every rank) as a tensor sharded like ``like`` (a DTensor or a plain tensor).

    Random values made per rank with ``randn_like`` would differ between the replicas of a replicated dimension,
    and DCP saves one replica: the checkpoint would depend on which."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    if not isinstance(like, DTensor):
        return full
    rep = distribute_tensor(full, like.device_mesh, [Replicate()] * like.device_mesh.ndim)
    return rep.redistribute(like.device_mesh, like.placements)


def _noise(p, scale: float, g: torch.Generator):
    return _same_everywhere(p, torch.randn(tuple(p.shape), generator=g) * scale)


def _adamw_steps(params, steps: int = 2) -> torch.optim.AdamW:
    """AdamW over ``params`` (tensors, or (name, tensor) pairs as torchtitan builds it) after ``steps`` steps on
    seeded random gradients (the same on every rank)."""
    opt = torch.optim.AdamW(params, lr=1e-3)
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        for p in tensors:
            p.grad = _noise(p, 0.01, g)
        opt.step()
    return opt


def write_torchtitan(out: str, family: str = "qwen3") -> None:
    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3.parallelize import parallelize_deepseekv3 as parallelize
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config as set_sharding

        cfg = torchtitan_dsv3_config()
    else:
        from torchtitan.models.qwen3.parallelize import parallelize_qwen3 as parallelize
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config as set_sharding

        cfg = torchtitan_config()
    # a trained load-balancing bias for DeepSeek-V3 (Qwen3-MoE computes none: its checkpoint keeps it zero)
    write_titan_model(out, cfg, parallelize, set_sharding, trained_bias=family == "deepseek_v3")


def write_titan_model(out: str, cfg, parallelize, set_sharding, *, trained_bias: bool = False) -> None:
    """torchtitan's own model of ``cfg`` parallelised by its ``parallelize`` (TP 2 x EP 2 over this gloo world),
    seeded weights, 2 AdamW steps, saved by ``dcp.save`` as torchtitan's checkpointer lays the state out."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims, parallel_dims

    # torchtitan picks "cuda" when no accelerator is found; its meshes must be CPU (gloo) meshes here.
    parallel_dims.device_type = "cpu"
    world = dist.get_world_size()
    dims = ParallelDims(
        dp_replicate=1, dp_shard=world // 2, cp=1, tp=2, pp=1, ep=2, world_size=world, spmd_backend="partial_dtensor"
    )
    dims.build_mesh()
    par = ParallelismConfig(
        data_parallel_shard_degree=world // 2,
        tensor_parallel_degree=2,
        expert_parallel_degree=2,
        spmd_backend="partial_dtensor",
    )
    set_sharding(cfg, enable_sp=False, enable_ep=True)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    parallelize(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=par,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=out,
    )
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.init_weights()
        for _, p in model.named_parameters():  # from seeded full tensors, so every replica holds the same values
            p.copy_(_noise(p, 0.1, g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias_E") and trained_bias:
                b.copy_(_noise(b, 0.05, g))
    opt = _adamw_steps(list(model.named_parameters()))
    state = {
        **ModelWrapper(model).state_dict(),
        "optimizer": get_flat_optim_state_dict(opt),
        "train_state": {"step": 2, "ntokens_seen": 64},
        "lr_scheduler": {"last_epoch": 2},
    }
    dcp.save(state, checkpoint_id=out)


def write_titan_names(out: str) -> None:
    """torchtitan's names and DTensor shardings without torchtitan: (Shard(0) over dp) x (TP splits)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    t = TINY
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("fsdp", "tp"))
    g = torch.Generator().manual_seed(7)
    hd, h = t["head_dim"], t["dim"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    full = {
        "tok_embeddings.weight": rand(t["vocab"], h),
        "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(t["vocab"], h),
    }
    for i in range(t["n_layers"]):
        p = f"layers.{i}."
        full.update(
            {
                p + "attention.qkv_linear.wq.weight": rand(t["n_heads"] * hd, h),
                p + "attention.qkv_linear.wk.weight": rand(t["n_kv_heads"] * hd, h),
                p + "attention.qkv_linear.wv.weight": rand(t["n_kv_heads"] * hd, h),
                p + "attention.wo.weight": rand(h, t["n_heads"] * hd),
                p + "attention.q_norm.weight": 1 + rand(hd),
                p + "attention.k_norm.weight": 1 + rand(hd),
                p + "moe.expert_bias_E": torch.zeros(t["experts"]),
                p + "moe.routed_experts.inner_experts.w1_EFD": rand(t["experts"], t["moe_hidden"], h),
                p + "moe.routed_experts.inner_experts.w2_EDF": rand(t["experts"], h, t["moe_hidden"]),
                p + "moe.routed_experts.inner_experts.w3_EFD": rand(t["experts"], t["moe_hidden"], h),
                p + "moe.router.gate.weight": rand(t["experts"], h),
                p + "attention_norm.weight": 1 + rand(h),
                p + "ffn_norm.weight": 1 + rand(h),
            }
        )

    def place(name: str, value: torch.Tensor):
        tp = (
            Shard(0)
            if name.endswith(("wq.weight", "wk.weight", "wv.weight", "w1_EFD", "w3_EFD"))
            else (Shard(1) if name.endswith(("wo.weight", "w2_EDF")) else Replicate())
        )
        if name.endswith(("w1_EFD", "w3_EFD")):
            tp = Shard(1)
        if name.endswith("w2_EDF"):
            tp = Shard(2)
        return distribute_tensor(value, mesh, [Shard(0), tp])

    model = {k: place(k, v) for k, v in full.items()}
    names = [k for k in model if not k.endswith("expert_bias_E")]
    params = [torch.nn.Parameter(model[k]) for k in names]
    opt = _adamw_steps(params)
    state: dict = {k: v for k, v in model.items() if k.endswith("expert_bias_E")}
    state.update({k: p.data for k, p in zip(names, params)})
    optim: dict = {}
    for k, p in zip(names, params):
        for s, v in opt.state[p].items():
            optim[f"state.{k}.{s}"] = v
        optim[f"param_groups.{k}.lr"] = 1e-3
    state.update({"optimizer": optim, "train_state": {"step": 2, "ntokens_seen": 64}})
    dcp.save(state, checkpoint_id=out)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({k: p.data.full_tensor() for k, p in zip(names, params)}, out + ".weights.safetensors")
    else:
        for p in params:
            p.data.full_tensor()  # full_tensor is collective: every rank takes part


def hf_mixtral_config_json() -> dict:
    """The Hugging Face ``config.json`` of the tiny model as Mixtral (what ``--model`` is given)."""
    t = TINY
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": t["vocab"],
        "hidden_size": t["dim"],
        "intermediate_size": t["moe_hidden"],
        "num_hidden_layers": t["n_layers"],
        "num_attention_heads": t["n_heads"],
        "num_key_value_heads": t["n_kv_heads"],
        "head_dim": t["head_dim"],
        "num_local_experts": t["experts"],
        "num_experts_per_tok": t["top_k"],
        "max_position_embeddings": 128,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "sliding_window": None,
        "tie_word_embeddings": False,
    }


def write_megatron(out: str, qk_layernorm: bool = True) -> None:
    """Megatron-Core's GPTModel with MoE layers (:func:`megatron_gpt`) saved by its own
    ``dist_checkpointing.save`` (torch_dist backend), and its own forward's logits beside it."""
    _save_megatron(megatron_gpt(qk_layernorm), out)


def megatron_logits(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens every Megatron test model is run on, and ``model``'s logits of them (Megatron's own forward)."""
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(16).repeat(2, 1)
    mask = torch.triu(torch.ones(16, 16), diagonal=1).bool()[None, None]
    with torch.no_grad():
        return tokens, model(tokens, positions, attention_mask=mask)


def _save_megatron(model, out: str) -> None:
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    tokens, logits = megatron_logits(model)
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    save_file({"tokens": tokens, "logits": logits.contiguous()}, out + ".logits.safetensors")


def megatron_gpt(qk_layernorm: bool = True, **fields):
    """Megatron-Core's tiny GPTModel with MoE layers (local spec, SequentialMLP experts), its weights seeded. With
    q/k layer norms it is a Qwen3-MoE; without, a Mixtral. ``fields``: more ``TransformerConfig`` fields (the
    parallel sizes and dtypes a training run sets, which decide its optimizer's parameter groups).

    Megatron-Core 0.16.1 assumes CUDA in a few places that this CPU build of torch does not have; each shim below
    replaces exactly one such call and changes no computation: ``torch.cuda.current_device()`` (the rotary
    embedding and the router move their tensors there) returns ``"cpu"``; ``torch.cuda.synchronize()`` (after the
    saver's device-to-host copies, which are synchronous on CPU) does nothing; ``te_general_gemm``, left undefined
    by the failed Transformer Engine import and read by the router, is ``None`` (Megatron's own non-TE branch).
    The causal mask is passed explicitly (Megatron's default one is made on ``device="cuda"``), dropout is off and
    the RNG tracker is Megatron's inference tracker (its training tracker needs CUDA RNG states).
    """
    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None
    if not ps.model_parallel_is_initialized():  # one process may write several models
        ps.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(0)
    t = TINY
    cfg = TransformerConfig(
        num_layers=t["n_layers"],
        hidden_size=t["dim"],
        num_attention_heads=t["n_heads"],
        num_query_groups=t["n_kv_heads"],
        kv_channels=t["head_dim"],
        ffn_hidden_size=t["dim"],
        num_moe_experts=t["experts"],
        moe_router_topk=t["top_k"],
        moe_ffn_hidden_size=t["moe_hidden"],
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        qk_layernorm=qk_layernorm,
        add_bias_linear=False,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        bf16=False,
        params_dtype=torch.float32,
        layernorm_epsilon=1e-6,
        moe_router_pre_softmax=False,
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp64",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg = dataclasses.replace(cfg, **fields)
    spec = get_gpt_layer_local_spec(
        num_experts=t["experts"], moe_grouped_gemm=False, qk_layernorm=qk_layernorm, normalization="RMSNorm"
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=t["vocab"],
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=1000000,
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones: make every weight distinct
            p.add_(torch.randn_like(p) * 0.05)
    return model


def write_megatron_dsv3(out: str) -> None:
    """Megatron-Core's GPTModel as DeepSeek-V3 (:func:`megatron_dsv3_gpt`) saved by its own
    ``dist_checkpointing.save``, its logits beside it."""
    _save_megatron(megatron_dsv3_gpt(), out)


def megatron_dsv3_gpt(**fields):
    """Megatron-Core's GPTModel as DeepSeek-V3 (``MLATransformerConfig``: latent attention with q_lora, one dense
    layer, then MoE layers of a shared expert and sigmoid-routed experts with group-limited top-k and a non-zero
    ``expert_bias``), the local spec, its weights seeded; ``fields`` as :func:`megatron_gpt`'s.

    Besides :func:`write_megatron`'s shims, Megatron-Core 0.16.1's latent attention needs two on the local spec
    (without Transformer Engine it fails to build): it hands its core attention ``k_channels``/``v_channels``,
    which only TE's attention takes (the local one sizes its output from ``kv_channels``, set here to
    ``v_head_dim``, and takes the softmax scale MLA passes, so the two are dropped); and it tests
    ``isinstance(..., TELinear)`` with ``TELinear`` undefined (a class nothing is an instance of stands in).
    """
    import torch.nn.functional as F

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class LocalAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    moe_utils.te_general_gemm = None
    multi_latent_attention.TELinear = type("NoTELinear", (), {})
    if not ps.model_parallel_is_initialized():  # one process may write several models
        ps.initialize_model_parallel(1, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    torch.manual_seed(0)
    t = TINY_DSV3
    cfg = MLATransformerConfig(
        num_layers=t["n_layers"],
        hidden_size=t["dim"],
        num_attention_heads=t["n_heads"],
        kv_channels=t["v_head_dim"],
        ffn_hidden_size=t["dense_hidden"],
        q_lora_rank=t["q_lora_rank"],
        kv_lora_rank=t["kv_lora_rank"],
        qk_head_dim=t["qk_nope_head_dim"],
        qk_pos_emb_head_dim=t["qk_rope_head_dim"],
        v_head_dim=t["v_head_dim"],
        rope_type="rope",
        rotary_base=t["rope_theta"],
        num_moe_experts=t["experts"],
        moe_router_topk=t["top_k"],
        moe_ffn_hidden_size=t["moe_hidden"],
        moe_shared_expert_intermediate_size=t["moe_hidden"] * t["shared_experts"],
        moe_layer_freq=[0] * t["n_dense_layers"] + [1] * (t["n_layers"] - t["n_dense_layers"]),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=t["groups"],
        moe_router_group_topk=t["limited_groups"],
        moe_router_topk_scaling_factor=t["route_scale"],
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        bf16=False,
        params_dtype=torch.float32,
        layernorm_epsilon=1e-5,
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp64",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    cfg = dataclasses.replace(cfg, **fields)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = LocalAttention
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=t["vocab"],
        max_sequence_length=128,
        position_embedding_type="rope",
        rotary_base=int(t["rope_theta"]),
        share_embeddings_and_output_weights=False,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones: make every weight distinct
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # a trained balancing bias: routing depends on it
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def run_gloo_worker(body) -> None:
    """A torchrun worker's life: join the gloo group, run ``body()``, agree at a barrier that every rank is done,
    then end without the interpreter's teardown (:func:`exit_without_teardown`); a failure tears the group down
    and is raised."""
    dist.init_process_group("gloo")
    try:
        body()
        dist.barrier()  # every rank done before any tears its gloo connections down (see testing/local_world.py)
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_without_teardown()


def main() -> None:
    kind, out = sys.argv[1], sys.argv[2]

    def body() -> None:
        writers = {
            "torchtitan": write_torchtitan,
            "torchtitan-dsv3": lambda o: write_torchtitan(o, "deepseek_v3"),
            "titan-names": write_titan_names,
            "megatron": write_megatron,
            "megatron-mixtral": lambda o: write_megatron(o, qk_layernorm=False),
            "megatron-dsv3": write_megatron_dsv3,
            # both in one process (one start of torch and Megatron): OUT.mixtral and OUT.dsv3
            "megatron-families": lambda o: (write_megatron(o + ".mixtral", False), write_megatron_dsv3(o + ".dsv3")),
        }
        writers[kind](out)

    run_gloo_worker(body)


def exit_without_teardown() -> None:
    """End a writer whose work is done and agreed (the barrier) without the interpreter's teardown.

    Tearing down gloo's worker threads at interpreter exit aborts the process now and then ("terminate called
    without an active exception", SIGABRT), after a save that succeeded; torchrun then reports the run failed.
    The process group is destroyed and the children this process started are ended while Python is intact, then
    the process ends at once, as reshard/processes.py ends its children.
    """
    import gc
    import multiprocessing

    gc.collect()
    dist.destroy_process_group()
    # A child the writer's framework started (Megatron's saver starts a multiprocessing Manager) holds the
    # inherited stdout and stderr pipes open: without the teardown that would end it, the test reading those
    # pipes waits for it forever.
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=30)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()


def save_sharded_generic(rank: int, out: str) -> None:
    """``dcp.save`` (DCP's own writer) of a DTensor row-sharded over 2 ranks and a plain tensor both hold."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    sd = {"w": distribute_tensor(torch.arange(48.0).reshape(8, 6), mesh, [Shard(0)]), "b": torch.ones(4)}
    dcp.save(sd, checkpoint_id=out)
