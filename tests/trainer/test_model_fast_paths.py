"""The training fast paths of our models compute what the reference paths compute (issue 8's throughput work).

* The grouped expert matmul leaves rows past its last offset unwritten; the experts' sync-free path routes the
  assignments no local expert takes (ZAYA's skip expert, other EP ranks' experts) there and must mask them, in the
  forward and in the input gradient: a poisoned tail (NaN) must not leak into outputs or gradients.
* That path must not read device values on the host (no ``nonzero``, ``bincount``, ``item``/``tolist``), which
  would make every layer wait for the GPU.
* ZAYA's CCA convolutions in channels-last layout equal the channels-first ones (transformers' layout).
* The vocabulary-parallel loss over the whole vocabulary equals the fused one.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moeckpt.trainer.models import layers, presets
from moeckpt.trainer.models.layers import Experts, build_model, cross_entropy
from moeckpt.trainer.models.zaya import model as zaya_model


def _experts(e: int = 8, h: int = 64, i: int = 32, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    ex = Experts(e, h, i)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    return ex


class _PoisonTail(torch.autograd.Function):
    """``torch._grouped_mm`` whose output and input gradient rows past ``offs[-1]`` are NaN (uninitialised memory
    at its worst), as the CUDA kernel is entitled to leave them."""

    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        y = _REAL_GROUPED_MM(x, w, offs=offs)
        y[int(offs[-1]) :] = float("nan")
        return y

    @staticmethod
    def backward(ctx, g):
        x, w, offs = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
            gx, gw = torch.autograd.grad(_REAL_GROUPED_MM(xd, wd, offs=offs), (xd, wd), g.contiguous())
        gx = gx.clone()
        gx[int(offs[-1]) :] = float("nan")
        return gx, gw, None


_REAL_GROUPED_MM = getattr(torch, "_grouped_mm", None)


@pytest.mark.skipif(
    _REAL_GROUPED_MM is None or not layers.grouped_mm_available(torch.device("cpu"), torch.float32),
    reason="this torch build has no CPU grouped matmul",
)
@pytest.mark.parametrize("k", [1, 2])
def test_unwritten_grouped_rows_never_leak(monkeypatch, k):
    ex = _experts()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g)
    index = torch.randint(0, 5, (40, k), generator=g)
    index[::3, 0] = 8  # no expert holds id 8 (ZAYA's skip expert): these rows go to the unwritten tail
    weights = torch.rand(40, k, generator=g)
    results = {}
    for impl in ("loop", "grouped"):
        if impl == "grouped":
            monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: _PoisonTail.apply(a, b, offs))
        ex.implementation = impl
        ex.zero_grad()
        xg = x.clone().requires_grad_(True)
        wg = weights.clone().requires_grad_(True)
        out = ex(xg, index, wg)
        out.square().sum().backward()
        results[impl] = (out, xg.grad, wg.grad, ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone())
    for a, b in zip(results["loop"], results["grouped"]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


class _HostReads(TorchDispatchMode):
    """Records operators that copy device values to the host or have data-dependent output shapes."""

    SYNCING = {"nonzero", "bincount", "_local_scalar_dense", "item", "unique", "_unique2", "masked_select"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.SYNCING:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_grouped_experts_never_read_device_values_on_the_host():
    ex = _experts()
    ex.implementation = "grouped"
    g = torch.Generator().manual_seed(4)
    x = torch.randn(30, 64, generator=g, requires_grad=True)
    index = torch.randint(0, 9, (30, 1), generator=g)  # id 8: held by no expert
    weights = torch.rand(30, 1, generator=g, requires_grad=True)
    with _HostReads() as mode:
        ex(x, index, weights).sum().backward()
    assert mode.seen == []
    with _HostReads() as mode:  # the recorder does see host reads (the experts' former nonzero and bincount)
        torch.bincount(index.reshape(-1)[index.reshape(-1).nonzero().squeeze(-1)])
        index.sum().item()
    assert mode.seen == ["nonzero", "bincount", "_local_scalar_dense"]


def test_cca_convolution_layouts_agree(monkeypatch):
    spec = presets()["zaya-tiny"]
    torch.manual_seed(0)
    model = build_model(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(0, spec.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(5))
    out = {}
    for layout in ("channels_first", "channels_last"):
        monkeypatch.setattr(zaya_model.CCAProjection, "conv_layout", layout)
        model.zero_grad()
        loss = model.loss(ids)
        loss.backward()
        out[layout] = (model(ids), [p.grad.clone() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(out["channels_last"][0], out["channels_first"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out["channels_last"][1], out["channels_first"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_vocab_parallel_loss_equals_the_fused_loss_over_the_whole_vocabulary():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 7, 50, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), generator=g)
    targets[0, :3] = layers.IGNORE_INDEX
    grads = []
    losses = []
    for split in (True, False):
        logits.grad = None
        loss = cross_entropy(logits, targets, split=split)
        loss.backward()
        losses.append(loss.detach())
        grads.append(logits.grad.clone())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-7)
    # every target ignored: 0 (not transformers' 0/0 NaN) on both paths
    none = torch.full_like(targets, layers.IGNORE_INDEX)
    assert cross_entropy(logits, none, split=True) == 0 and cross_entropy(logits, none, split=False) == 0
