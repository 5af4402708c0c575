"""Mixtral <-> Hugging Face: ``config.json`` and the two expert layouts.

transformers 5 holds the router as ``mlp.gate`` and the experts fused; ``save_pretrained`` and the Hub's Mixtral
checkpoints store ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2``
(down). Both read; exports write the Hub's layout.
"""

from __future__ import annotations

from ..checkpoint_config import generation_config  # noqa: F401  (part of the mapping)
from ..hf_layout import ExpertLayout
from .config import MixtralConfig

#: what the index's model config must hold for an export.
HF_FIELDS = (*MixtralConfig.shape_fields(), "hf_config")

_LAYOUT = ExpertLayout(
    count=lambda cfg: cfg.num_local_experts,
    leaves=(("gate_up_proj", ("w1.weight", "w3.weight")), ("down_proj", ("w2.weight",))),
    mlp="block_sparse_moe",
)


def to_hf_config(cfg: MixtralConfig, *, dtype: str = "float32") -> dict:
    return cfg.to_hf(dtype)


def from_hf_config(doc: dict) -> MixtralConfig:
    derived = {}
    if doc.get("hidden_size") and doc.get("num_attention_heads"):
        derived["head_dim"] = doc["hidden_size"] // doc["num_attention_heads"]
    return MixtralConfig.from_hf(doc, **derived)


#: the expert layouts' mapping functions (see :class:`~moeckpt.trainer.models.hf_layout.ExpertLayout`).
export_tensors = _LAYOUT.export_tensors
export_values = _LAYOUT.export_values
import_sources = _LAYOUT.import_sources
import_source_shapes = _LAYOUT.import_source_shapes
import_rows = _LAYOUT.import_rows
