"""Checkpoints of other frameworks: torch DCP (torchtitan, Megatron-Core ``torch_dist``) in and out.

``dcp_import`` converts a DCP checkpoint into any moeckpt layout (``--mapping none`` keeps it generic;
``torchtitan`` maps it onto the plan of its family, ``qwen3_moe`` or ``deepseek_v3``, and ``megatron`` onto
``qwen3_moe``, ``mixtral`` or ``deepseek_v3``); ``dcp_export`` writes a moeckpt checkpoint
back as a standard DCP checkpoint with torch's own ``dcp.save``.
"""

from .common import Mapped, MappingError
from .dcp_import import MAPPINGS, DcpImport, apply_mapping, import_dcp

__all__ = ["MAPPINGS", "DcpImport", "Mapped", "MappingError", "apply_mapping", "import_dcp"]
