"""Qwen2-MoE's shape fields (named as ``transformers.Qwen2MoeConfig`` names them, with its defaults) and presets."""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint_config import CheckpointConfig, check_divides


@dataclass(frozen=True, kw_only=True)
class Qwen2MoeConfig(CheckpointConfig):
    """Qwen2-MoE: GQA attention with q/k/v biases; MoE layers of routed experts plus one shared expert whose output
    a sigmoid gate scales; dense layers where ``mlp_only_layers`` or ``decoder_sparse_step`` say."""

    MODEL_TYPE = "qwen2_moe"
    ARCHITECTURE = "Qwen2MoeForCausalLM"
    REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads")
    BOUNDS = {"decoder_sparse_step": (1, 100_000)}

    vocab_size: int = 151936
    hidden_size: int = 2048
    #: the dense layers' MLP size.
    intermediate_size: int = 5632
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    num_experts: int = 60
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    qkv_bias: bool = True
    tie_word_embeddings: bool = False

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        layers = self.mlp_only_layers
        if not isinstance(layers, tuple) or not all(type(x) is int and 0 <= x < self.num_hidden_layers for x in layers):
            raise ValueError(f"mlp_only_layers={layers!r} must be a list of layer numbers")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` is a MoE layer (transformers' rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        tp_fields = {
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
        }
        if not all(self.is_sparse(x) for x in range(self.num_hidden_layers)):
            tp_fields["intermediate_size"] = self.intermediate_size
        check_divides(tp, ep, tp_fields=tp_fields, ep_fields={"num_experts": self.num_experts})


PRESETS: dict[str, Qwen2MoeConfig] = {
    "qwen2moe-tiny": Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        hf_config={"num_experts_per_tok": 2},
    ),
    # Qwen1.5-MoE-A2.7B's shape, for planning.
    "qwen2moe-a2.7b": Qwen2MoeConfig(hf_config={"num_experts_per_tok": 4}),
}
