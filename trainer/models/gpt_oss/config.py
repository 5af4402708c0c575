"""gpt-oss's shape fields (named as ``transformers.GptOssConfig`` names them, with its defaults) and presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint_config import CheckpointConfig, check_divides


@dataclass(frozen=True, kw_only=True)
class GptOssConfig(CheckpointConfig):
    """gpt-oss: GQA attention with biases and a learned sink logit per head, alternating sliding and full
    attention, a biased softmax router, experts with biases whose gate and up columns interleave."""

    MODEL_TYPE = "gpt_oss"
    ARCHITECTURE = "GptOssForCausalLM"
    REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

    vocab_size: int = 201088
    hidden_size: int = 2880
    #: each expert's intermediate size (gpt-oss has no dense MLP).
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    attention_bias: bool = True
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


PRESETS: dict[str, GptOssConfig] = {
    "gptoss-tiny": GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        hf_config={
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # gpt-oss-20b's shape (its bf16 weights), for planning.
    "gptoss-20b": GptOssConfig(num_hidden_layers=24, num_local_experts=32),
}
