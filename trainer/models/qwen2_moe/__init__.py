"""Qwen2-MoE: config and presets, sharding plan and Hugging Face mapping (a checkpoint format: no trainer module)."""

from .config import PRESETS, Qwen2MoeConfig
from .plan import param_specs

ARCH = "qwen2_moe"
CONFIG_CLASS = Qwen2MoeConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "Qwen2MoeConfig", "param_specs"]
