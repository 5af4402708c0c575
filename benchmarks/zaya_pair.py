"""Our ZAYA module and transformers' ``ZayaForCausalLM`` with the same weights, and their training step: shared by
``bench_model_gpu.py`` and ``profile_model_gpu.py``."""

from __future__ import annotations

import torch


def build_pair(preset: str, dev: torch.device, dtype: torch.dtype):
    """(ours, transformers') with identical weights on ``dev`` in ``dtype``, both in training mode."""
    from transformers import ZayaConfig as HfZayaConfig
    from transformers import ZayaForCausalLM as HfZaya

    from moeckpt.trainer.models import resolve_model
    from moeckpt.trainer.models.layers import build_model
    from moeckpt.trainer.models.zaya.hf import to_hf_config

    spec = resolve_model(preset)
    torch.manual_seed(0)
    ours = build_model(spec).to(dev, dtype)
    doc = to_hf_config(spec.config, dtype=str(dtype).removeprefix("torch."))
    hf = HfZaya(HfZayaConfig(**{k: v for k, v in doc.items() if k not in ("architectures", "model_type")}))
    hf = hf.to(dev, dtype)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise SystemExit(f"state dicts differ: {missing[:5]} {unexpected[:5]}")
    return ours.train(), hf.train(), spec.config


def fused_adamw(model) -> torch.optim.Optimizer:
    """The optimizer both models train with in these benchmarks."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)


def train_step(loss_fn, opt: torch.optim.Optimizer):
    """One training step: forward (``loss_fn``), backward, optimizer step."""

    def step():
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
