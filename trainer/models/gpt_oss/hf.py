"""gpt-oss <-> Hugging Face: ``config.json``; tensors under the plan's names (transformers, ``save_pretrained``
and the Hub's bf16 checkpoints all store the experts fused, so there is one layout)."""

from __future__ import annotations

from ..checkpoint_config import generation_config  # noqa: F401  (part of the mapping)
from ..hf_layout import FusedOnly
from .config import GptOssConfig

#: what the index's model config must hold for an export.
HF_FIELDS = (*GptOssConfig.shape_fields(), "hf_config")

_LAYOUT = FusedOnly()


def to_hf_config(cfg: GptOssConfig, *, dtype: str = "float32") -> dict:
    return cfg.to_hf(dtype)


def from_hf_config(doc: dict) -> GptOssConfig:
    derived = {}
    if "num_key_value_heads" in doc and doc["num_key_value_heads"] is None:
        derived["num_key_value_heads"] = doc.get("num_attention_heads")
    return GptOssConfig.from_hf(doc, **derived)


#: the mapping functions (names are the plan's).
export_tensors = _LAYOUT.export_tensors
export_values = _LAYOUT.export_values
import_sources = _LAYOUT.import_sources
import_source_shapes = _LAYOUT.import_source_shapes
import_rows = _LAYOUT.import_rows
