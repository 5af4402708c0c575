"""DeepSeek-V3 <-> Hugging Face: ``config.json`` and the two expert layouts (``mlp.experts.{e}.gate_proj/up_proj/
down_proj`` as ``save_pretrained`` and the Hub store them, or fused as transformers 5 holds them; exports write the
per-expert one). The Hub's FP8 checkpoints (``quantization_config``, ``weight_scale_inv`` tensors) are refused."""

from __future__ import annotations

from ..checkpoint_config import generation_config  # noqa: F401  (part of the mapping)
from ..hf_layout import ExpertLayout
from .config import DeepseekV3Config

#: what the index's model config must hold for an export.
HF_FIELDS = (*DeepseekV3Config.shape_fields(), "hf_config")

_LAYOUT = ExpertLayout(count=lambda cfg: cfg.n_routed_experts)


def to_hf_config(cfg: DeepseekV3Config, *, dtype: str = "float32") -> dict:
    return cfg.to_hf(dtype)


def from_hf_config(doc: dict) -> DeepseekV3Config:
    return DeepseekV3Config.from_hf(doc)


def with_tensors(cfg: DeepseekV3Config, shapes: dict) -> DeepseekV3Config:
    """``cfg`` with the multi-token-prediction tensors among an HF directory's tensors (``shapes``) recorded."""
    return cfg.with_tensors(shapes)


#: the expert layouts' mapping functions (see :class:`~moeckpt.trainer.models.hf_layout.ExpertLayout`).
export_tensors = _LAYOUT.export_tensors
export_values = _LAYOUT.export_values
import_sources = _LAYOUT.import_sources
import_source_shapes = _LAYOUT.import_source_shapes
import_rows = _LAYOUT.import_rows
