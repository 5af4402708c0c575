"""The two Hugging Face layouts of a MoE family's experts, and the config.json of a checkpoint-only family.

transformers 5 holds experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``:
the names the plans use), and so does a state dict saved as it is. ``save_pretrained`` and the checkpoints on the
Hub store them one matrix per expert (``mlp.experts.{e}.gate_proj.weight``, Mixtral's ``w1/w3/w2`` under
``block_sparse_moe``), which transformers' conversion mapping fuses at load time. :class:`ExpertLayout` reads
either, tensor by tensor, and writes the per-expert one (what ``save_pretrained`` writes and every version loads).

A family's ``hf.py`` binds one :class:`ExpertLayout` and exposes its methods as the mapping functions
``hf_import`` and ``hf_export`` call (``export_tensors``, ``export_values``, ``import_sources``,
``import_source_shapes``, ``import_rows``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


_FUSED = re.compile(r"^(model\.layers\.\d+\.)(mlp)\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertLayout:
    """How one family stores its fused plan tensors per expert.

    ``leaves``: plan tensor (``gate_up_proj``, ``down_proj``) -> the per-expert tensors concatenated along their
    dim 0 to make one expert's matrix. ``mlp``: the name of the MoE block in the per-expert layout (Mixtral's
    ``block_sparse_moe``), which renames every tensor of that block there. ``count``: the number of routed
    experts of a config.
    """

    count: Callable[[Any], int]
    leaves: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("gate_up_proj", ("gate_proj.weight", "up_proj.weight")),
        ("down_proj", ("down_proj.weight",)),
    )
    mlp: str = "mlp"

    def _legacy(self, name: str) -> str:
        """A non-expert plan tensor's name in the per-expert layout (only the MoE block's name differs)."""
        if self.mlp == "mlp":
            return name
        return re.sub(r"^(model\.layers\.\d+\.)mlp\.(gate\.)", rf"\g<1>{self.mlp}.\g<2>", name)

    def _parts(self, name: str, cfg) -> list[str] | None:
        m = _FUSED.match(name)
        if m is None:
            return None
        layer, _, which = m.groups()
        leaves = dict(self.leaves)[which]
        return [f"{layer}{self.mlp}.experts.{e}.{leaf}" for e in range(self.count(cfg)) for leaf in leaves]

    def export_tensors(self, name: str, shape: tuple[int, ...], cfg) -> list[tuple[str, tuple[int, ...]]]:
        """The HF tensors (name, shape) a plan tensor is written as: fused experts become per-expert matrices."""
        parts = self._parts(name, cfg)
        if parts is None:
            return [(self._legacy(name), tuple(shape))]
        e, rows, cols = shape
        per = len(parts) // e
        return [(p, (rows // per, cols)) for p in parts]

    def export_values(self, name: str, tensor, cfg) -> dict:
        """A plan tensor's values under the names :meth:`export_tensors` gives (views, no copies): of a tensor, or
        of its bytes viewed with its shape (:func:`moeckpt.formats.checkpoint.byte_view`), cut along the first
        two dimensions only."""
        parts = self._parts(name, cfg)
        if parts is None:
            return {self._legacy(name): tensor}
        per = len(parts) // tensor.shape[0]
        rows = tensor.shape[1] // per
        out = {}
        for e in range(tensor.shape[0]):
            for i, p in enumerate(parts[e * per : (e + 1) * per]):
                out[p] = tensor[e, i * rows : (i + 1) * rows]  # a torch tensor or a byte view (numpy) alike
        return out

    def import_sources(self, name: str, cfg, available) -> list[str]:
        """The HF tensors plan tensor ``name`` is read from: itself when the directory holds it (fused layout),
        else its per-expert layout's tensors."""
        if name in available:
            return [name]
        parts = self._parts(name, cfg)
        return [self._legacy(name)] if parts is None else parts

    def import_source_shapes(self, name: str, shape: tuple[int, ...], cfg, available) -> list[tuple[str, tuple]]:
        """:meth:`import_sources` with the shape each must have, checked before anything is written."""
        if name in available:
            return [(name, tuple(shape))]
        return self.export_tensors(name, shape, cfg)

    def import_rows(self, name: str, cfg, available, read_rows, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of plan tensor ``name``; a fused tensor's rows are experts, so a per-expert
        checkpoint is read only for the experts asked for."""
        import torch

        if name in available:
            return read_rows(name, r0, r1)
        parts = self._parts(name, cfg)
        if parts is None:
            return read_rows(self._legacy(name), r0, r1)
        per = len(parts) // self.count(cfg)
        return torch.stack(
            [torch.cat([read_rows(p, 0, None) for p in parts[e * per : (e + 1) * per]]) for e in range(r0, r1)]
        )


@dataclass(frozen=True)
class FusedOnly:
    """A family whose only HF layout is the plan's (gpt-oss: transformers and the Hub both store fused experts)."""

    def export_tensors(self, name: str, shape: tuple[int, ...], cfg) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tuple(shape))]

    def export_values(self, name: str, tensor, cfg) -> dict:
        return {name: tensor}

    def import_sources(self, name: str, cfg, available) -> list[str]:
        return [name]

    def import_source_shapes(self, name: str, shape: tuple[int, ...], cfg, available) -> list[tuple[str, tuple]]:
        return [(name, tuple(shape))]

    def import_rows(self, name: str, cfg, available, read_rows, r0: int, r1: int) -> torch.Tensor:
        return read_rows(name, r0, r1)


#: config.json fields a checkpoint-only family does not carry over: they say who wrote the file, not the model.
VOLATILE = frozenset({"transformers_version", "_name_or_path", "dtype", "torch_dtype", "model_type"})


def hf_config_from(doc: dict, shape_fields) -> dict:
    """The config.json fields a checkpoint-only config keeps verbatim: all but its shape fields and
    :data:`VOLATILE`, so that an export writes back every option that changes what the model computes (RoPE
    scaling, routing constants, sliding windows) without the plan having to know it."""
    return {k: v for k, v in doc.items() if k not in VOLATILE and k not in shape_fields}


def refuse_quantized(doc: dict, family: str) -> None:
    """Refuse a quantized checkpoint (DeepSeek-V3's FP8 blocks, gpt-oss's MXFP4 experts): their tensors are not
    the weights, and a plan of weights would read scales as values."""
    q = doc.get("quantization_config")
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise ValueError(
            f"a {method}-quantized {family} checkpoint (quantization_config) is not supported: moeckpt converts "
            "unquantized (bf16 or fp32) weights; dequantize it first (e.g. transformers' from_pretrained with "
            "dequantize, then save_pretrained)"
        )
