"""Qwen3-MoE: config and presets, sharding plan (the module and Hugging Face mapping live beside them)."""

from .config import PRESETS, Qwen3MoeConfig
from .plan import param_specs

ARCH = "qwen3_moe"
CONFIG_CLASS = Qwen3MoeConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "Qwen3MoeConfig", "param_specs"]
