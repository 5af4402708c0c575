"""GLM-4.5 (glm4_moe): config and presets, sharding plan and Hugging Face mapping (a checkpoint format: no trainer module)."""

from .config import PRESETS, Glm4MoeConfig
from .plan import param_specs, untrained

ARCH = "glm4_moe"
CONFIG_CLASS = Glm4MoeConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "Glm4MoeConfig", "param_specs", "untrained"]
