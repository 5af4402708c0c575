"""Our ZAYA1, Qwen3-MoE and DeepSeek-V3 modules compute what transformers computes, and their shards add up to the whole.

Parity: the same weights (our state dict loaded into transformers' model under the same names) give logits within
1e-5 in fp32 on CPU. Sharding: each simulated TP/EP rank, holding the boxes its plan rules give it, computes a
partial result; the partial results sum to the unsharded module's output, which is what the collectives will do.
"""

from __future__ import annotations

import pytest
import torch

from moeckpt.reshard.layout import Layout
from moeckpt.reshard.placement import model_parallel_boxes
from moeckpt.reshard.tensors import logical_tensors
from moeckpt.trainer.hf_export import hf_module
from moeckpt.trainer.models import presets
from moeckpt.trainer.models.layers import Experts, Shard, VocabEmbedding, build_model, cross_entropy, rotary_cos_sin

transformers = pytest.importorskip("transformers")

TINY = ["zaya-tiny", "qwen3moe-tiny"]
#: every trainable family (DeepSeek-V3's attention takes no part in the GQA shard test below, which reads head_dim;
#: its TP/EP shards are checked end to end in tests/trainer/test_train_deepseek_v3.py).
ALL_TINY = [*TINY, "deepseekv3-tiny"]


def perturbed_model(preset: str, seed: int = 0, spec=None) -> torch.nn.Module:
    """A tiny model whose every tensor is distinct (norm weights, biases and scales off their 1/0 defaults)."""
    spec = spec or presets()[preset]
    torch.manual_seed(seed)
    model = build_model(spec)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.add_(torch.randn_like(t) * 0.05)
        # Token-dependent routing: embeddings and ZAYA's router weights large enough that tokens go to every
        # expert, ZAYA's skip expert (class E) included, rather than all to the one a bias favours.
        model.model.embed_tokens.weight.normal_(0, 1.0)
        if spec.arch == "zaya":
            for layer in model.model.layers:
                router = layer.mlp.gate
                router.balancing_biases.normal_(0, 0.01)
                for lin in (router.down_proj, router.router_mlp.fc1, router.router_mlp.fc2, router.router_mlp.out_proj):
                    lin.weight.normal_(0, lin.weight.shape[1] ** -0.5)
    return model.eval()


def transformers_model(preset: str, state: dict, spec=None) -> torch.nn.Module:
    spec = spec or presets()[preset]
    doc = dict(hf_module(spec).to_hf_config(spec.config))
    cfg = transformers.AutoConfig.for_model(doc.pop("model_type"), **doc)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if spec.config.tie_word_embeddings else []
    assert (missing, unexpected) == (tied, [])
    return hf


@pytest.mark.parametrize("preset", ALL_TINY)
def test_logits_equal_transformers(preset):
    ours = perturbed_model(preset)
    hf = transformers_model(preset, ours.state_dict())
    _check_logits(ours, hf)


def _check_logits(ours, hf) -> None:
    g = torch.Generator().manual_seed(1)
    for batch, seq in [(1, 1), (2, 17), (3, 64)]:
        ids = torch.randint(0, ours.config.vocab_size, (batch, seq), generator=g)
        with torch.no_grad():
            ours_logits, hf_logits = ours(ids), hf(ids).logits
        assert ours_logits.shape == hf_logits.shape
        torch.testing.assert_close(ours_logits, hf_logits, rtol=0, atol=1e-5)
        if seq == 1:
            continue  # no next token: transformers' loss is 0/0
        # The loss helper is transformers' causal-LM loss (labels = inputs, shifted inside).
        with torch.no_grad():
            torch.testing.assert_close(ours.loss(ids), hf(ids, labels=ids).loss, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "change",
    [
        # full-rank queries (DeepSeek-V2-Lite's q_proj), rotate-half RoPE, biases on the attention projections
        {"q_lora_rank": None, "hf_config": {"rope_interleave": False}, "attention_bias": True},
        # plain top-k weights, one group (no group limit), another scale, two shared experts, no dense layer
        {
            "first_k_dense_replace": 0,
            "n_shared_experts": 2,
            "hf_config": {"norm_topk_prob": False, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5},
        },
    ],
    ids=["q_proj-rotate_half-bias", "no-group-limit"],
)
def test_deepseek_v3_options_equal_transformers(change):
    """The DeepSeek-V3 config options the tiny preset leaves at one value compute what transformers computes too."""
    import dataclasses

    base = presets()["deepseekv3-tiny"]
    hf_config = {**base.config.hf_config, **change.get("hf_config", {})}
    spec = dataclasses.replace(base, config=dataclasses.replace(base.config, **{**change, "hf_config": hf_config}))
    ours = perturbed_model("", spec=spec)
    _check_logits(ours, transformers_model("", ours.state_dict(), spec=spec))


def test_deepseek_v3_bias_picks_experts_but_does_not_weight_them():
    """The correction bias changes which experts a token goes to, never the weights of the chosen ones (the plain
    sigmoid scores); a training forward counts the load that balancing reads."""
    model = perturbed_model("deepseekv3-tiny").train()
    gate = model.model.layers[1].mlp.gate
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        gate.e_score_correction_bias.zero_()
        w0, i0 = gate(x)
        gate.e_score_correction_bias.copy_(torch.tensor([1.0, -1.0, -1.0, -1.0]))  # expert 0 always chosen
    gate.take_load()
    with torch.enable_grad():
        w1, i1 = gate(x)
    assert (i1 == 0).any(dim=-1).all() and not torch.equal(i0, i1)
    scores = torch.sigmoid(x @ gate.weight.T)
    want = scores.gather(1, i1)
    want = want / want.sum(dim=-1, keepdim=True) * gate.rt.routed_scaling_factor
    torch.testing.assert_close(w1.detach(), want, rtol=0, atol=1e-6)
    assert gate.take_load().tolist() == torch.bincount(i1.reshape(-1), minlength=4).tolist()
    assert gate.load.sum() == 0


def test_zaya_skip_expert_is_exercised():
    """The parity test above covers tokens routed to the skip expert (class E) as well as to real experts."""
    model = perturbed_model("zaya-tiny")
    ids = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(1))
    chosen = []
    hook = model.model.layers[1].mlp.gate.register_forward_hook(lambda m, i, out: chosen.append(out[1]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    e = model.config.num_experts
    assert (chosen[0] == e).any() and (chosen[0] < e).any()


@pytest.mark.parametrize("preset", ALL_TINY)
def test_gradients_flow_to_every_trained_parameter(preset):
    model = perturbed_model(preset).train()
    ids = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(2))
    model.loss(ids).backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert [n for n, p in trained if p.grad is None or not p.grad.abs().sum() > 0] == []
    # every plan tensor is a parameter (frozen ZAYA balancing biases included), so optimizers and checkpoints see it
    assert {n for n, _ in model.named_parameters()} == set(model.state_dict())


def _experts(e: int, h: int, i: int, shard: Shard = Shard(), seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    ex = Experts(e, h, i, shard)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    return ex


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_equals_loop(dtype):
    """Both expert paths on CPU: outputs and gradients agree, with empty experts and out-of-range (skip) ids."""
    ex = _experts(8, 64, 32).to(dtype)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 64, generator=g, dtype=dtype)
    index = torch.randint(0, 5, (40, 2), generator=g)  # experts 5..7 get nothing
    index[::7, 1] = 8  # an id no expert holds (ZAYA's skip expert) contributes nothing
    weights = torch.rand(40, 2, generator=g).to(dtype)
    results = {}
    for impl in ("loop", "grouped"):
        ex.implementation = impl
        xg = x.clone().requires_grad_(True)
        ex.zero_grad()
        out = ex(xg, index, weights)
        out.square().sum().backward()
        results[impl] = (out, xg.grad, ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone())
    tol = {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for a, b in zip(results["loop"], results["grouped"]):
        torch.testing.assert_close(a, b, **tol)
    assert results["loop"][2][5:].abs().sum() == 0  # experts without tokens get no gradient


def test_expert_shards_sum_to_the_whole():
    """EP x TP: each rank holds global experts [start, stop) and an intermediate slice; partial outputs add up."""
    e, h, i = 8, 64, 32
    full = _experts(e, h, i)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50, h, generator=g)
    index = torch.randint(0, e, (50, 2), generator=g)
    weights = torch.rand(50, 2, generator=g)
    want = full(x, index, weights)
    total = torch.zeros_like(want)
    for ep_rank in range(2):
        for tp_rank in range(2):
            shard = Shard(tp=2, tp_rank=tp_rank, ep=2, ep_rank=ep_rank)
            part = Experts(e, h, i, shard)
            lo, hi = part.expert_start, part.expert_stop
            with torch.no_grad():
                gate, up = full.gate_up_proj[lo:hi].chunk(2, dim=1)
                s = slice(tp_rank * i // 2, (tp_rank + 1) * i // 2)
                part.gate_up_proj.copy_(torch.cat([gate[:, s], up[:, s]], dim=1))
                part.down_proj.copy_(full.down_proj[lo:hi, :, s])
            assert lo == ep_rank * e // 2  # global expert ids, never renumbered from 0
            total += part(x, index, weights)
    torch.testing.assert_close(total, want, rtol=0, atol=1e-5)


def shard_state(model: torch.nn.Module, preset: str, layout: Layout, tp_rank: int, ep_rank: int) -> dict:
    """The rank's local tensors cut from the full state dict by the plan's sharding rules (boxes concatenated)."""
    spec = presets()[preset]
    full = model.state_dict()
    out = {}
    for name, entry in logical_tensors(spec.param_specs()).items():
        boxes = model_parallel_boxes(entry, layout, tp_rank, ep_rank)
        dim = entry.sharding["tp"]["dim"] if "tp" in entry.sharding else 0
        out[name] = torch.cat([full[name][b.slices()] for b in boxes], dim=dim)
    return out


@pytest.mark.parametrize("preset", TINY)
def test_attention_and_embedding_shards_sum_to_the_whole(preset):
    """tp=2: each rank's attention (its KV heads, query heads, CCA channels and value halves) gives a partial sum
    of the output projection; vocabulary-split embeddings sum to the lookup; the vocab-split loss pieces match."""
    spec = presets()[preset]
    full = perturbed_model(preset)
    layout = Layout(tp=2, ep=1, dp=1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 9, spec.config.hidden_size, generator=g)
    ids = torch.randint(0, spec.config.vocab_size, (2, 9), generator=g)
    rot = int(spec.config.head_dim * getattr(spec.config, "partial_rotary_factor", 1.0))
    cos, sin = rotary_cos_sin(torch.arange(9), rot, spec.config.rope_theta, torch.float32)
    with torch.no_grad():
        want_attn = full.model.layers[1].self_attn(x, cos, sin)
        want_emb = full.model.embed_tokens(ids)
        logits = full(ids)
    attn = torch.zeros_like(want_attn)
    emb = torch.zeros_like(want_emb)
    for rank in range(2):
        part = build_model(spec, Shard(tp=2, tp_rank=rank))
        part.load_state_dict(shard_state(full, preset, layout, rank, 0), strict=True)
        with torch.no_grad():
            attn += part.model.layers[1].self_attn(x, cos, sin)
            emb += part.model.embed_tokens(ids)
    torch.testing.assert_close(attn, want_attn, rtol=0, atol=1e-5)
    torch.testing.assert_close(emb, want_emb, rtol=0, atol=0)
    # Vocabulary-parallel loss equals the ordinary one when the slice is the whole vocabulary.
    targets = ids.roll(-1, dims=1)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    torch.testing.assert_close(cross_entropy(logits, targets, split=True), want)
    torch.testing.assert_close(cross_entropy(logits, targets), want)


def test_vocab_embedding_zeroes_other_ranks_tokens():
    emb = VocabEmbedding(8, 4, Shard(tp=2, tp_rank=1))
    with torch.no_grad():
        emb.weight.copy_(torch.arange(16.0).view(4, 4) + 1)
    out = emb(torch.tensor([[0, 4, 7]]))
    assert (
        out[0, 0].abs().sum() == 0 and torch.equal(out[0, 1], emb.weight[0]) and torch.equal(out[0, 2], emb.weight[3])
    )


def test_grouped_mm_falls_back_to_the_loop_where_the_build_lacks_it(monkeypatch):
    """A build whose torch._grouped_mm raises (no kernel for this GPU/dtype) must take the loop, same numbers."""
    import torch

    from moeckpt.trainer.models import layers

    def broken(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    monkeypatch.setattr(layers, "_GROUPED_MM_WORKS", {})
    assert not layers.grouped_mm_available(torch.device("cpu"), torch.float32)
    ex = layers.Experts(4, 16, 32)
    g = torch.Generator().manual_seed(0)
    for p in ex.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(10, 16, generator=g)
    idx = torch.randint(0, 4, (10, 1), generator=g)
    w = torch.rand(10, 1, generator=g)
    ex.implementation = "auto"
    auto = ex(x, idx, w)
    ex.implementation = "loop"
    assert torch.allclose(auto, ex(x, idx, w))
