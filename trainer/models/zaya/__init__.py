"""ZAYA1: config and presets, sharding plan (the module and Hugging Face mapping live beside them)."""

from .config import PRESETS, ZayaConfig
from .plan import param_specs

ARCH = "zaya"
CONFIG_CLASS = ZayaConfig

__all__ = ["ARCH", "CONFIG_CLASS", "PRESETS", "ZayaConfig", "param_specs"]
