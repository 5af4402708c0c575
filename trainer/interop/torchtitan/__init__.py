"""torchtitan's checkpoints <-> moeckpt's model plans, one module per model family torchtitan implements:
:mod:`.qwen3` (``torchtitan.models.qwen3`` <-> ``qwen3_moe``), :mod:`.deepseek_v3`
(``torchtitan.models.deepseek_v3`` <-> ``deepseek_v3``) and :mod:`.gpt_oss` (``torchtitan.models.gpt_oss`` <->
``gpt_oss``); :mod:`.shared` holds what they share (the grouped experts, the flattened optimizer, the train state).

torchtitan's checkpoint (``CheckpointManager``, or ``dcp.save`` of its states) holds the model's state dict at the
top level, the optimizer flattened by parameter (``optimizer.state.<fqn>.exp_avg``, ``.exp_avg_sq``, ``.step``;
``optimizer.param_groups.<fqn>.lr``...), and ``train_state.step``, ``lr_scheduler.*``, ``dataloader.*`` values.
The family is told by the names (DeepSeek-V3's latent attention has ``attention.wkv_a``, gpt-oss's attention
``attention.sinks``); a ``--model`` of another family is refused.
"""

from __future__ import annotations

from types import ModuleType

from moeckpt.formats.dcp import DcpCheckpoint

from ...models import ModelSpec
from ..common import Mapped, MappingError
from . import deepseek_v3, gpt_oss, qwen3

#: the plan architectures torchtitan has, and the module mapping each.
FAMILIES: dict[str, ModuleType] = {qwen3.ARCH: qwen3, deepseek_v3.ARCH: deepseek_v3, gpt_oss.ARCH: gpt_oss}


def looks_like(names) -> bool:
    """Whether a DCP checkpoint's tensor names are torchtitan's."""
    return "tok_embeddings.weight" in names


def family(arch: str, where: str) -> ModuleType:
    """The mapping module of plan architecture ``arch``; a :class:`MappingError` if torchtitan has no such model."""
    if arch not in FAMILIES:
        raise MappingError(
            f"{where}: torchtitan's checkpoints map onto {', '.join(FAMILIES)} models; this one is {arch!r} "
            "(use --mapping none)"
        )
    return FAMILIES[arch]


def map_torchtitan(dcp: DcpCheckpoint, model: ModelSpec | None = None) -> Mapped:
    """A torchtitan checkpoint as the plan of its family (told by its names), optimizer moments included."""
    found = next((f for f in (deepseek_v3, gpt_oss) if f.looks_like(dcp.tensors)), qwen3)
    if model is not None and model.arch in FAMILIES and FAMILIES[model.arch] is not found:
        raise MappingError(
            f"{dcp.location}: --model names a {model.arch} model, but the checkpoint's tensors are torchtitan's "
            f"{found.ARCH}"
        )
    return found.map_checkpoint(dcp, model)
