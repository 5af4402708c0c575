"""Model architectures: each folder holds config and presets, sharding plan, module and Hugging Face mapping."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from moeckpt.formats.errors import MoeckptError

from . import qwen3_moe, zaya

ARCHITECTURES: dict[str, ModuleType] = {zaya.ARCH: zaya, qwen3_moe.ARCH: qwen3_moe}
#: Hugging Face ``model_type`` values accepted in a config.json, mapped to our architecture names.
HF_MODEL_TYPES = {"zaya": "zaya", "qwen3_moe": "qwen3_moe"}


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

    def check_layout(self, tp: int, ep: int) -> None:
        self.config.check_layout(tp, ep)

    def to_json(self) -> dict:
        return {"arch": self.arch, "config": self.config.to_json()}

    @classmethod
    def from_json(cls, value: dict) -> "ModelSpec":
        arch = value.get("arch")
        if arch not in ARCHITECTURES:
            raise UnknownModelError(f"unknown model architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")
        try:
            return cls(arch, ARCHITECTURES[arch].CONFIG_CLASS.from_json(value.get("config", {})))
        except (TypeError, ValueError) as e:
            raise UnknownModelError(f"model config for {arch!r} is invalid: {e}") from None


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
            return ModelSpec.from_json(doc)
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
