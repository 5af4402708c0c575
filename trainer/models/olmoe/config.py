"""OLMoE's shape fields (named as ``transformers.OlmoeConfig`` names them, with its defaults) and presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint_config import CheckpointConfig, check_divides


@dataclass(frozen=True, kw_only=True)
class OlmoeConfig(CheckpointConfig):
    """OLMoE: GQA attention with RMS norms over the whole q and k width, softmax top-k router, SwiGLU experts."""

    MODEL_TYPE = "olmoe"
    ARCHITECTURE = "OlmoeForCausalLM"
    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

    vocab_size: int = 50304
    hidden_size: int = 2048
    #: each expert's intermediate size (OLMoE has no dense MLP).
    intermediate_size: int = 2048
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    num_experts: int = 64
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads} and "
                f"num_key_value_heads={self.num_key_value_heads} must divide one another"
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
            ep_fields={"num_experts": self.num_experts},
        )


PRESETS: dict[str, OlmoeConfig] = {
    "olmoe-tiny": OlmoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        hf_config={"num_experts_per_tok": 2, "eos_token_id": None, "pad_token_id": None},
    ),
    # OLMoE-1B-7B's shape, for planning.
    "olmoe-1b-7b": OlmoeConfig(intermediate_size=1024, hf_config={"num_experts_per_tok": 8}),
}
