"""torchtitan's own gpt-oss writing a DCP checkpoint (run under torchrun, gloo on CPU): ``titan_gptoss_worker.py OUT``.

The tiny model is built with torchtitan's own per-layer builders (``_make_gptoss_attn_config``,
``_make_gptoss_experts_config``; its ``_build_gptoss_layers`` fixes 64 heads of 64), parallelized by its own
``parallelize_gptoss`` over 2 ranks (TP 2, EP 2 borrowing the TP ranks: DTensors), given two AdamW steps on seeded
random gradients (flex attention has no CPU backward) and saved by ``dcp.save`` with the state torchtitan's
checkpointer saves: the model at the top level, the optimizer flattened by parameter (its own
``get_flat_optim_state_dict``), ``train_state`` and ``lr_scheduler``.

Besides the sizes, it is gpt-oss as torchtitan's flavors build it: biased fused Q/K/V, sinks, a sliding window on
the even layers, YaRN RoPE (theta 150000, factor 32), a biased softmax router, biased interleaved SwiGLU experts and
the (zero, untrained) load-balancing ``expert_bias_E``.
"""

from __future__ import annotations

import sys

#: the tiny gpt-oss: 2 layers (sliding window 8, then full attention), GQA 4 heads over 2, 4 experts, top 2.
TINY_GPTOSS = {
    "dim": 64,
    "head_dim": 16,
    "n_layers": 2,
    "vocab": 256,
    "n_heads": 4,
    "n_kv_heads": 2,
    "hidden": 32,
    "experts": 4,
    "top_k": 2,
    "window": 8,
    "rope_theta": 150000.0,
    "rope_factor": 32.0,
    "original_seq_len": 4096,
}


def torchtitan_gptoss_config():
    """torchtitan's gpt-oss config at the tiny size, from torchtitan's own builders."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models.gpt_oss import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        GptOssModel,
        _depth_init,
        _make_gptoss_attn_config,
        _make_gptoss_experts_config,
        _output_linear_init,
    )
    from torchtitan.models.gpt_oss.model import GptOssTransformerBlock
    from torchtitan.models.gpt_oss.moe import GptOssMoE

    t = TINY_GPTOSS
    rope = CosSinRoPE.Config(
        dim=t["head_dim"],
        max_seq_len=128,
        theta=t["rope_theta"],
        scaling="yarn",
        rope_factor=t["rope_factor"],
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_seq_len=t["original_seq_len"],
    )
    layers = []
    for i in range(t["n_layers"]):  # as _build_gptoss_layers, at the tiny head count
        attention = _make_gptoss_attn_config(
            dim=t["dim"],
            layer_id=i,
            attn_backend="flex",
            n_heads=t["n_heads"],
            n_kv_heads=t["n_kv_heads"],
            head_dim=t["head_dim"],
            sliding_window_size=t["window"] if i % 2 == 0 else None,
            fuse_qkv=True,
            rope=rope,
        )
        experts = _make_gptoss_experts_config(
            dim=t["dim"],
            hidden_dim=t["hidden"],
            num_experts=t["experts"],
            layer_id=i,
            top_k=t["top_k"],
            moe_comm_backend="standard",
        )
        router = TokenChoiceTopKRouter.Config(
            num_experts=t["experts"],
            score_func="softmax",
            route_norm=True,
            gate=Linear.Config(in_features=t["dim"], out_features=t["experts"], bias=True, param_init=_depth_init(i)),
            top_k=t["top_k"],
        )
        moe = GptOssMoE.Config(num_experts=t["experts"], load_balance_coeff=1e-3, routed_experts=experts, router=router)
        layers.append(
            GptOssTransformerBlock.Config(
                attention=attention,
                attention_norm=RMSNorm.Config(normalized_shape=t["dim"], param_init=_NORM_INIT),
                ffn_norm=RMSNorm.Config(normalized_shape=t["dim"], param_init=_NORM_INIT),
                moe=moe,
            )
        )
    return GptOssModel.Config(
        vocab_size=t["vocab"],
        dim=t["dim"],
        tok_embeddings=Embedding.Config(num_embeddings=t["vocab"], embedding_dim=t["dim"], param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=t["dim"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=t["dim"], out_features=t["vocab"], param_init=_output_linear_init(t["dim"])),
        layers=layers,
    )


def hf_gptoss_config_json() -> dict:
    """The Hugging Face ``config.json`` of the tiny gpt-oss (what ``--model`` is given): the routing, window and
    RoPE fields no tensor shape tells, and torchtitan's RMSNorm eps (1e-5, as gpt-oss's)."""
    t = TINY_GPTOSS
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": t["vocab"],
        "hidden_size": t["dim"],
        "intermediate_size": t["hidden"],
        "num_hidden_layers": t["n_layers"],
        "num_attention_heads": t["n_heads"],
        "num_key_value_heads": t["n_kv_heads"],
        "head_dim": t["head_dim"],
        "num_local_experts": t["experts"],
        "num_experts_per_tok": t["top_k"],
        "sliding_window": t["window"],
        "layer_types": ["sliding_attention", "full_attention"],
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
        "swiglu_limit": 7.0,
        "max_position_embeddings": int(t["original_seq_len"] * t["rope_factor"]),
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": t["rope_theta"],
            "factor": t["rope_factor"],
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": t["original_seq_len"],
        },
        "tie_word_embeddings": False,
    }


def write(out: str) -> None:
    from torchtitan.models.gpt_oss.parallelize import parallelize_gptoss
    from torchtitan.models.gpt_oss.sharding import set_gpt_oss_sharding_config

    from tests.dcp_workers import write_titan_model

    write_titan_model(out, torchtitan_gptoss_config(), parallelize_gptoss, set_gpt_oss_sharding_config)


def main() -> None:
    from tests.dcp_workers import run_gloo_worker

    run_gloo_worker(lambda: write(sys.argv[1]))


if __name__ == "__main__":
    main()
