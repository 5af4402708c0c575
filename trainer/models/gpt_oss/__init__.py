"""gpt-oss: config and presets, sharding plan and Hugging Face mapping (a checkpoint format: no trainer module)."""

from .config import PRESETS, GptOssConfig
from .plan import param_specs

ARCH = "gpt_oss"
CONFIG_CLASS = GptOssConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "GptOssConfig", "param_specs"]
