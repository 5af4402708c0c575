"""DeepSeek-V3: config and presets, sharding plan, Hugging Face mapping, and the trainer module (``model.py``)."""

from .config import PRESETS, DeepseekV3Config
from .plan import param_specs, untrained
from .runtime import runtime

ARCH = "deepseek_v3"
CONFIG_CLASS = DeepseekV3Config


def check_trainable(cfg: DeepseekV3Config) -> None:
    """Raise ``UnsupportedDeepseekConfigError`` (a ValueError) for a config the trainer would compute differently
    from transformers: what ``moeckpt train`` checks before any worker starts."""
    runtime(cfg)


__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "DeepseekV3Config", "check_trainable", "param_specs", "untrained"]
