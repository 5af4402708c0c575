"""OLMoE: config and presets, sharding plan and Hugging Face mapping (a checkpoint format: no trainer module)."""

from .config import PRESETS, OlmoeConfig
from .plan import param_specs

ARCH = "olmoe"
CONFIG_CLASS = OlmoeConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "OlmoeConfig", "param_specs"]
