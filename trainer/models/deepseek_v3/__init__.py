"""DeepSeek-V3: config and presets, sharding plan, Hugging Face mapping, and the trainer module (``model.py``)."""

from .config import PRESETS, DeepseekV3Config
from .plan import param_specs, untrained

ARCH = "deepseek_v3"
CONFIG_CLASS = DeepseekV3Config

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "DeepseekV3Config", "param_specs", "untrained"]
