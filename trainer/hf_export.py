"""Export a moeckpt checkpoint as a Hugging Face model directory (placeholder: filled in below)."""

from __future__ import annotations

import importlib
from types import ModuleType


def hf_module(spec) -> ModuleType:
    """The ``<arch>/hf.py`` mapping module of a :class:`~moeckpt.trainer.models.ModelSpec`."""
    return importlib.import_module(f"{spec.module.__name__}.hf")
