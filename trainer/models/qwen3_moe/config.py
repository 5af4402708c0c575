"""Qwen3-MoE model configuration and presets (field names follow ``transformers.Qwen3MoeConfig``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..base import check_fields, check_moe_layout, config_from_json

#: ranges of the fields that are not plain sizes (1..MAX_DIM); checked before anything is built.
_BOUNDS = {
    "num_hidden_layers": (1, 100_000),
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e11),
    "initializer_range": (0.0, 10.0),
}


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig:
    """Qwen3-MoE: GQA attention with q/k RMS norms, softmax top-k router, SwiGLU experts."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_fields(self, _BOUNDS, open_low=frozenset({"rms_norm_eps", "rope_theta"}))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary embedding rotates channel pairs)")

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        check_moe_layout(self, tp, ep)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> Qwen3MoeConfig:
        return config_from_json(cls, value)


PRESETS: dict[str, Qwen3MoeConfig] = {
    "qwen3moe-tiny": Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B's shape, for planning.
    "qwen3moe-30b-a3b": Qwen3MoeConfig(),
}
