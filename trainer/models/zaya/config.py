"""ZAYA1 model configuration and presets (field names follow ``transformers.ZayaConfig``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..base import check_fields, check_moe_layout, config_from_json

#: ranges of the fields that are not plain sizes (1..MAX_DIM); checked before anything is built.
_BOUNDS = {
    "cca_time0": (1, 1024),
    "cca_time1": (1, 1024),
    "num_hidden_layers": (1, 100_000),
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e11),
    "partial_rotary_factor": (0.0, 1.0),
    "initializer_range": (0.0, 10.0),
}


@dataclass(frozen=True, kw_only=True)
class ZayaConfig:
    """The ZAYA1 architecture: CCA attention, ZAYA router with EDA and a skip expert, top-1 experts, residual scaling."""

    vocab_size: int = 262272
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    moe_intermediate_size: int = 2048
    num_experts: int = 16
    num_experts_per_tok: int = 1
    router_hidden_size: int = 256
    cca_time0: int = 2
    cca_time1: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 5_000_000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_fields(self, _BOUNDS, open_low=frozenset({"rms_norm_eps", "rope_theta", "partial_rotary_factor"}))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if (self.num_key_value_heads * self.head_dim) % 2:
            raise ValueError("num_key_value_heads * head_dim must be even (the value path is split in halves)")
        if self.num_experts_per_tok != 1:
            raise ValueError("ZAYA routes each token to one expert: num_experts_per_tok must be 1")

    def check_layout(self, tp: int, ep: int) -> None:
        """Refuse a layout this model cannot take, naming the conflicting fields."""
        check_moe_layout(self, tp, ep)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict) -> ZayaConfig:
        return config_from_json(cls, value)


PRESETS: dict[str, ZayaConfig] = {
    # CPU tests and the demo: byte-level vocabulary, ~150k parameters.
    "zaya-tiny": ZayaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=64,
        num_experts=4,
        router_hidden_size=16,
        max_position_embeddings=4096,
    ),
    # A model a single GPU trains at a useful rate (GPU benchmarks, elastic runs on H200).
    "zaya-small": ZayaConfig(
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        moe_intermediate_size=1024,
        num_experts=16,
        router_hidden_size=128,
        max_position_embeddings=8192,
    ),
    # The real ZAYA1-8B shape (transformers' ZayaConfig defaults): for planning and storage benchmarks only.
    "zaya1-8b": ZayaConfig(),
}
