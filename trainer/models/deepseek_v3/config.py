"""DeepSeek-V3's shape fields (named as ``transformers.DeepseekV3Config`` names them, with its defaults) and
presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import MAX_DIM
from ..checkpoint_config import CarriesMtp, check_divides


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(CarriesMtp):
    """DeepSeek-V3: multi-head latent attention (low-rank q and kv projections), ``first_k_dense_replace`` dense
    layers, then MoE layers of shared experts plus routed experts chosen by a sigmoid router with group-limited
    top-k and a correction bias (``e_score_correction_bias``) that balances load without a loss."""

    MODEL_TYPE = "deepseek_v3"
    ARCHITECTURE = "DeepseekV3ForCausalLM"
    REQUIRED = (
        "vocab_size",
        "hidden_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
        "kv_lora_rank",
    )
    BOUNDS = {"first_k_dense_replace": (0, 100_000), "n_shared_experts": (0, 1024)}

    vocab_size: int = 129280
    hidden_size: int = 7168
    #: the dense layers' MLP size.
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    kv_lora_rank: int = 512
    #: ``None``: queries are one full-rank projection (``q_proj``), as in DeepSeek-V2-Lite.
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    first_k_dense_replace: int = 3
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        q = self.q_lora_rank
        if q is not None and (type(q) is not int or not 1 <= q <= MAX_DIM):
            raise ValueError(f"q_lora_rank={q!r} must be null or an integer in 1..{MAX_DIM}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # The fields below shape no tensor, so they live in ``hf_config`` (verbatim from the config.json); the trainer
    # reads them with transformers' defaults. :func:`.runtime.runtime` checks their values before a build.

    def hf(self, name: str, default):
        """``hf_config[name]``, or transformers' ``default`` where the config.json leaves it out (or null)."""
        value = self.hf_config.get(name)
        return default if value is None else value

    @property
    def initializer_range(self) -> float:
        return self.hf("initializer_range", 0.02)

    @property
    def max_position_embeddings(self) -> int:
        return self.hf("max_position_embeddings", 4096)

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` is a MoE layer (the first ``first_k_dense_replace`` are dense)."""
        return layer >= self.first_k_dense_replace

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        tp_fields = {
            "num_attention_heads": self.num_attention_heads,
            "vocab_size": self.vocab_size,
            "moe_intermediate_size": self.moe_intermediate_size,
        }
        if self.first_k_dense_replace:
            tp_fields["intermediate_size"] = self.intermediate_size
        check_divides(tp, ep, tp_fields=tp_fields, ep_fields={"n_routed_experts": self.n_routed_experts})


PRESETS: dict[str, DeepseekV3Config] = {
    "deepseekv3-tiny": DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        n_routed_experts=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        first_k_dense_replace=1,
        hf_config={"num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "num_key_value_heads": 4},
    ),
    # DeepSeek-V3's (671B) shape, for planning.
    "deepseekv3-671b": DeepseekV3Config(),
}
