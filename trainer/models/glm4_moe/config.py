"""GLM-4.5's shape fields (named as ``transformers.Glm4MoeConfig`` names them, with its defaults) and presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint_config import CarriesMtp, check_divides


@dataclass(frozen=True, kw_only=True)
class Glm4MoeConfig(CarriesMtp):
    """GLM-4.5 (``glm4_moe``): GQA attention with optional q/k/v biases and per-head q/k norms, partial rotary,
    ``first_k_dense_replace`` dense layers, then MoE layers of shared experts plus routed experts chosen by a
    sigmoid router with a correction bias, as DeepSeek-V3's."""

    MODEL_TYPE = "glm4_moe"
    ARCHITECTURE = "Glm4MoeForCausalLM"
    REQUIRED = (
        "vocab_size",
        "hidden_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "n_routed_experts",
    )
    BOUNDS = {"first_k_dense_replace": (0, 100_000), "n_shared_experts": (0, 1024)}

    vocab_size: int = 151552
    hidden_size: int = 4096
    #: the dense layers' MLP size.
    intermediate_size: int = 10944
    moe_intermediate_size: int = 1408
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 128
    first_k_dense_replace: int = 1
    attention_bias: bool = False
    use_qk_norm: bool = False
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` is a MoE layer (the first ``first_k_dense_replace`` are dense)."""
        return layer >= self.first_k_dense_replace

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        tp_fields = {
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "moe_intermediate_size": self.moe_intermediate_size,
        }
        if self.first_k_dense_replace:
            tp_fields["intermediate_size"] = self.intermediate_size
        check_divides(tp, ep, tp_fields=tp_fields, ep_fields={"n_routed_experts": self.n_routed_experts})


PRESETS: dict[str, Glm4MoeConfig] = {
    "glm4moe-tiny": Glm4MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=4,
        attention_bias=True,
        use_qk_norm=True,
        hf_config={"num_experts_per_tok": 2},
    ),
    # GLM-4.5-Air's shape, for planning.
    "glm4moe-air": Glm4MoeConfig(
        num_attention_heads=96,
        hidden_size=4096,
        attention_bias=True,
        hf_config={"num_experts_per_tok": 8, "routed_scaling_factor": 1.0},
    ),
}
