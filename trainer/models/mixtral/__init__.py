"""Mixtral: config and presets, sharding plan and Hugging Face mapping (a checkpoint format: no trainer module)."""

from .config import PRESETS, MixtralConfig
from .plan import param_specs

ARCH = "mixtral"
CONFIG_CLASS = MixtralConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "MixtralConfig", "param_specs"]
