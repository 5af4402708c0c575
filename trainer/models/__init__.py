"""Model architectures: each folder holds config and presets, sharding plan, Hugging Face mapping and, for the
architectures the bundled trainer runs (``model.py``), the module. The others are checkpoint formats: imported,
resharded and exported by their plan and mapping alone."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from moeckpt.formats.errors import MoeckptError

from . import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe, zaya

ARCHITECTURES: dict[str, ModuleType] = {
    m.ARCH: m for m in (zaya, qwen3_moe, deepseek_v3, mixtral, olmoe, gpt_oss, qwen2_moe, glm4_moe)
}
#: Hugging Face ``model_type`` values accepted in a config.json, mapped to our architecture names (each
#: architecture is named as transformers names its model type).
HF_MODEL_TYPES = {arch: arch for arch in ARCHITECTURES}


class UnknownModelError(MoeckptError, ValueError):
    """An unknown preset, architecture or unreadable model config."""


@dataclass(frozen=True)
class ModelSpec:
    """An architecture name plus its config: enough to build the model and its sharding plan."""

    arch: str
    config: Any

    @property
    def module(self) -> ModuleType:
        return ARCHITECTURES[self.arch]

    def param_specs(self):
        return self.module.param_specs(self.config)

    @property
    def trainable(self) -> bool:
        """Whether the bundled trainer runs this architecture (its folder has a ``model.py``)."""
        return importlib.util.find_spec(f"{self.module.__name__}.model") is not None

    def require_trainable(self) -> None:
        """Raise :class:`UnknownModelError` unless the bundled trainer runs this architecture with this config
        (a family's ``check_trainable(config)``, where it has one, refuses values its module does not compute)."""
        if not self.trainable:
            runs = ", ".join(a for a in ARCHITECTURES if ModelSpec(a, None).trainable)
            raise UnknownModelError(
                f"the bundled trainer does not run {self.arch} models (it runs {runs}); {self.arch} is a checkpoint "
                "format: import-hf, reshard, export-hf and the DCP mappings convert it"
            )
        check = getattr(self.module, "check_trainable", None)
        if check is not None:
            try:
                check(self.config)
            except ValueError as e:
                raise UnknownModelError(str(e)) from None

    def untrained(self) -> frozenset[str]:
        """Parameters no optimizer steps (DeepSeek-V3's routing correction bias, moved by a balancing rule):
        checkpoints keep their values and no optimizer state for them."""
        fn = getattr(self.module, "untrained", None)
        return frozenset(fn(self.config)) if fn is not None else frozenset()

    def check_layout(self, tp: int, ep: int) -> None:
        self.config.check_layout(tp, ep)

    def to_json(self) -> dict:
        return {"arch": self.arch, "config": self.config.to_json()}

    @classmethod
    def from_json(cls, value: dict, where: str = "model config") -> ModelSpec:
        """Parse ``{"arch": ..., "config": {...}}`` strictly: an unknown key (at the top or inside "config") is an
        error, never silently dropped (a flat ``{"arch": "zaya", "hidden_size": 64}`` used to become ZAYA1-8B)."""
        if not isinstance(value, dict):
            raise UnknownModelError(f'{where}: must be a JSON object {{"arch": ..., "config": {{...}}}}')
        arch = value.get("arch")
        if arch not in ARCHITECTURES:
            raise UnknownModelError(f"{where}: unknown model architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
        config_class = ARCHITECTURES[arch].CONFIG_CLASS
        known = {f.name for f in dataclasses.fields(config_class)}
        unexpected = sorted(set(value) - {"arch", "config"})
        if unexpected:
            where_fields = (
                '; model fields belong under "config": {"arch": ..., "config": {"hidden_size": ...}}'
                if set(unexpected) & known
                else '; the only top-level keys are "arch" and "config"'
            )
            raise UnknownModelError(f"{where}: unexpected top-level key(s) {', '.join(unexpected)}{where_fields}")
        config = value.get("config")
        if not isinstance(config, dict):
            raise UnknownModelError(
                f'{where}: needs a "config" object holding the {arch} fields '
                f'({{"arch": {arch!r}, "config": {{...}}}}; got {type(config).__name__}); '
                "use a preset name for a default config"
            )
        unknown = sorted(set(config) - known)
        if unknown:
            raise UnknownModelError(
                f"{where}: unknown {arch} config field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}"
            )
        try:
            return cls(arch, config_class.from_json(config))
        except (TypeError, ValueError) as e:
            raise UnknownModelError(f"{where}: {arch} config is invalid: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())


def presets() -> dict[str, ModelSpec]:
    return {name: ModelSpec(mod.ARCH, cfg) for mod in ARCHITECTURES.values() for name, cfg in mod.PRESETS.items()}


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a JSON file: either ``{"arch": ..., "config": {...}}`` or a Hugging Face config.json."""
    table = presets()
    if name_or_path in table:
        return table[name_or_path]
    if name_or_path.endswith(".json") or os.path.isfile(name_or_path):
        try:
            with open(name_or_path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise UnknownModelError(f"{name_or_path}: cannot read model config: {e}") from None
        if not isinstance(doc, dict):
            raise UnknownModelError(f"{name_or_path}: model config must be a JSON object")
        if "arch" in doc:
            return ModelSpec.from_json(doc, where=name_or_path)
        model_type = doc.get("model_type")
        if model_type in HF_MODEL_TYPES:
            # A Hugging Face config: its own mapping reads nested fields (ZAYA's rope_parameters, Qwen's
            # num_local_experts) that a plain field-by-field copy would miss.
            arch = HF_MODEL_TYPES[model_type]
            hf = importlib.import_module(f"{__name__}.{arch}.hf")
            try:
                return ModelSpec(arch, hf.from_hf_config(doc))
            except (TypeError, ValueError) as e:
                raise UnknownModelError(f"{name_or_path}: {e}") from None
        raise UnknownModelError(
            f"{name_or_path}: config has no 'arch' and an unsupported model_type {model_type!r}; "
            f"supported: {', '.join(HF_MODEL_TYPES)}"
        )
    raise UnknownModelError(f"unknown model preset {name_or_path!r}; presets: {', '.join(sorted(table))}")
