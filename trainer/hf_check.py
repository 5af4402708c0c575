"""Does ``transformers`` compute what our model computes? The check behind ``moeckpt demo`` and the ``hf`` extra.

Needs ``transformers`` (the ``hf`` or ``demo`` extra): imported when the check runs, not with this module.
"""

from __future__ import annotations

from typing import Any

import torch

from moeckpt.formats.checkpoint import CheckpointReader
from moeckpt.formats.roles import PARAM

from .models import ModelSpec
from .models.layers import build_model


def logits_difference(ckpt: str, hf_dir: str, *, batch: int = 2, seq: int = 48, seed: int = 0) -> float:
    """The largest |logit difference| between our model built from checkpoint ``ckpt`` and the Hugging Face model
    that ``transformers.AutoModelForCausalLM`` loads from ``hf_dir`` (an ``export-hf`` of it), in float32 on the
    CPU, on ``batch`` random sequences of ``seq`` tokens. Every key must load: missing or unexpected keys raise."""
    from transformers import AutoModelForCausalLM

    reader = CheckpointReader(ckpt)
    spec = ModelSpec.from_json(reader.index.model)
    ours = build_model(spec)
    params = {n: reader.read_tensor(n) for n, e in reader.index.tensors.items() if e.role == PARAM}
    ours.load_state_dict(params, strict=True)
    loaded: Any = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    theirs, info = loaded  # the model and what was missing, unexpected or mismatched
    unloaded = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if unloaded:
        raise ValueError(f"transformers did not load {hf_dir} whole: {unloaded}")
    ids = torch.randint(0, spec.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return float((ours(ids) - theirs(input_ids=ids).logits).abs().max())
