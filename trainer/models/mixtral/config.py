"""Mixtral's shape fields (named as ``transformers.MixtralConfig`` names them, with its defaults) and presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint_config import CheckpointConfig, check_divides


@dataclass(frozen=True, kw_only=True)
class MixtralConfig(CheckpointConfig):
    """Mixtral: GQA attention without biases, softmax top-k router, SwiGLU experts of ``intermediate_size``."""

    MODEL_TYPE = "mixtral"
    ARCHITECTURE = "MixtralForCausalLM"
    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

    vocab_size: int = 32000
    hidden_size: int = 4096
    #: each expert's intermediate size (Mixtral has no dense MLP).
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    num_local_experts: int = 8
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        check_divides(
            tp,
            ep,
            tp_fields={
                "num_key_value_heads": self.num_key_value_heads,
                "vocab_size": self.vocab_size,
                "intermediate_size": self.intermediate_size,
            },
            ep_fields={"num_local_experts": self.num_local_experts},
        )


PRESETS: dict[str, MixtralConfig] = {
    "mixtral-tiny": MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        hf_config={"num_experts_per_tok": 2},
    ),
    # Mixtral-8x7B's shape, for planning.
    "mixtral-8x7b": MixtralConfig(hf_config={"num_experts_per_tok": 2, "rope_theta": 1e6}),
}
