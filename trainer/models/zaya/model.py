"""The ZAYA1 model for training, computing exactly what ``transformers.ZayaForCausalLM`` computes (no KV cache).

Parameter names and shapes follow the plan (``plan.param_specs``), so ``state_dict()`` is the checkpoint's and
transformers' state dict. Every module holds only its :class:`~moeckpt.trainer.models.layers.Shard`: attention
the key/value heads ``[kv_start, kv_stop)`` and the query heads that read them, experts a global expert range and
a slice of the intermediate dimension, the embedding a vocabulary range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import (
    SINGLE_PROCESS,
    CausalLM,
    Collectives,
    Experts,
    Linear,
    RMSNorm,
    Shard,
    VocabEmbedding,
    apply_rotary,
    apply_rotary_tables,
    causal_attention,
    empty_param,
    init_from_plan,
    rotary_cos_sin,
    rotary_tables,
)
from .config import ZayaConfig
from .plan import param_specs


class CCAProjection(nn.Module):
    """Compressed Convolutional Attention's q/k/v: q/k mixed by two causal convolutions plus residual paths, and a
    value whose second half comes from the previous token (``v_proj_delayed``).

    The four projections keep their own parameters (the checkpoint's names) but run as one matmul over their
    concatenated weights: one GEMM forward and two backward instead of four and eight, and no concatenation of the
    q and k activations for the convolutions.
    """

    #: ``"channels_last"`` runs the two convolutions on ``[B, T, C]`` data as 1 x k 2-D convolutions in channels-last
    #: layout (what the projection produces; no transposes); ``"channels_first"`` as ``nn.Conv1d`` on ``[B, C, T]``,
    #: as transformers does; ``"auto"``: channels-last on GPUs, channels-first elsewhere. The same arithmetic either
    #: way (rounded in another order); which is faster depends on the convolution library.
    conv_layout = "channels_first"

    def __init__(self, cfg: ZayaConfig, shard: Shard) -> None:
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.groups = cfg.num_attention_heads // cfg.num_key_value_heads
        kv_lo, kv_hi = shard.tp_range(cfg.num_key_value_heads, "num_key_value_heads")
        self.num_kv = kv_hi - kv_lo
        self.num_heads = self.num_kv * self.groups
        q, kv = self.num_heads * hd, self.num_kv * hd
        self.q_proj = Linear(cfg.hidden_size, q)
        self.k_proj = Linear(cfg.hidden_size, kv)
        # The value heads are cat([current, delayed]) viewed as heads: this rank's heads cover the channel window
        # [kv_lo * hd, kv_hi * hd) of that concatenation, which may hold all, part or none of either half.
        half = cfg.num_key_value_heads * hd // 2
        lo, hi = kv_lo * hd, kv_hi * hd
        self.v_proj_current = Linear(cfg.hidden_size, max(0, min(hi, half) - lo))
        self.v_proj_delayed = Linear(cfg.hidden_size, max(0, hi - max(lo, half)))
        channels = q + kv
        self.conv_qk_depthwise = nn.Conv1d(channels, channels, cfg.cca_time0, groups=channels)
        self.conv_qk_grouped = nn.Conv1d(channels, channels, cfg.cca_time1, groups=self.num_heads + self.num_kv)
        self.pad = (cfg.cca_time0 - 1) + (cfg.cca_time1 - 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [B, T, H]`` -> query and key heads ``[B, T, heads + kv_heads, D]`` (queries first), value
        ``[B, T, kv_heads, D]``."""
        b, t, _ = x.shape
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv
        nq, nk = nh * hd, nkv * hd
        vc, vd = self.v_proj_current.weight, self.v_proj_delayed.weight
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, vc, vd])
        # split, not slicing: its backward is one concatenation, where each slice's would be a zero-filled
        # full-width gradient summed with the others.
        qk_lin, v_cur, v_del = F.linear(x, weight).split([nq + nk, vc.shape[0], vd.shape[0]], dim=-1)
        q_lin, k_lin = qk_lin.split([nq, nk], dim=-1)
        # Residual paths: each query head averaged with its key head (broadcast over the group, no repeated copy);
        # each key head the mean of its group.
        q_res = (q_lin.view(b, t, nkv, self.groups, hd) + k_lin.view(b, t, nkv, 1, hd)) * 0.5
        res = torch.cat([q_res.view(b, t, nh, hd), q_res.mean(dim=-2)], dim=2)
        # The sum takes the convolution output's memory layout (it comes first), as in transformers: the L2 norms
        # that follow then reduce in the same order, so fp32 results match transformers' bit for bit on CPU.
        qk = self._conv(qk_lin).unflatten(-1, (nh + nkv, hd)) + res
        # The delayed half at position i is the projection of token i-1 (zeros before the first token).
        delayed = F.pad(v_del[:, :-1], (0, 0, 1, 0))
        value = torch.cat([v_cur, delayed], dim=-1).view(b, t, nkv, hd)
        return qk, value

    def _conv(self, qk: torch.Tensor) -> torch.Tensor:
        """Both causal convolutions over time of ``qk [B, T, C]`` -> ``[B, T, C]`` (a view, maybe strided)."""
        dw, gr = self.conv_qk_depthwise, self.conv_qk_grouped
        layout = self.conv_layout
        if layout == "auto":
            layout = "channels_last" if qk.is_cuda else "channels_first"
        if layout == "channels_last":
            # [B, T, C] memory is a channels-last [B, C, 1, T] image: the 1-D kernels become 1 x k 2-D kernels.
            h = F.pad(qk, (0, 0, self.pad, 0)).unsqueeze(1).permute(0, 3, 1, 2)  # causal: pad the past only
            h = F.conv2d(h, dw.weight.unsqueeze(2), dw.bias, groups=dw.groups)
            h = F.conv2d(h, gr.weight.unsqueeze(2), gr.bias, groups=gr.groups)
            return h.permute(0, 2, 3, 1).flatten(1, 2)
        h = F.pad(qk.transpose(1, 2), (self.pad, 0))
        return gr(dw(h)).transpose(1, 2)


class QKNorm(nn.Module):
    """q and k L2-normalised to length sqrt(head_dim); keys then scaled by a learned per-KV-head ``temp``."""

    def __init__(self, num_kv: int, head_dim: int) -> None:
        super().__init__()
        self.scale = head_dim**0.5
        self.temp = empty_param(num_kv)

    def forward(self, qk: torch.Tensor, num_heads: int) -> torch.Tensor:
        """``qk [B, T, heads + kv_heads, D]`` (queries first), normalised in one pass over both."""
        eps = torch.finfo(qk.dtype).eps
        qk = qk * (self.scale / qk.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        # Query heads times exactly 1, key heads times temp: one multiply instead of slicing out the keys.
        return qk * F.pad(self.temp, (num_heads, 0), value=1.0)[:, None]


class Attention(nn.Module):
    """CCA attention over this rank's heads; with TP the output projection gives a partial sum, reduced here."""

    def __init__(self, cfg: ZayaConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        qkv_proj = CCAProjection(cfg, shard)
        # Registration order gives transformers' state-dict order (o_proj first).
        self.o_proj = Linear(qkv_proj.num_heads * cfg.head_dim, cfg.hidden_size)
        self.qkv_proj = qkv_proj
        self.qk_norm = QKNorm(qkv_proj.num_kv, cfg.head_dim)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``tables``: :func:`rotary_tables` of ``cos, sin`` when the caller shares them over layers."""
        nh = self.qkv_proj.num_heads
        qk, v = self.qkv_proj(self.comm.tp_enter(x))
        qk = self.qk_norm(qk, nh)
        if tables is None:
            tables = rotary_tables(cos, sin, qk.shape[-1])
        if tables is not None:
            # q and k rotated together: [B, T, heads, D] against [T, 1, D] tables.
            qk = apply_rotary_tables(qk, tables[0][:, None], tables[1][:, None], cos.shape[-1]).transpose(1, 2)
        else:
            qk = apply_rotary(qk.transpose(1, 2), cos, sin)
        if qk.stride(-1) != 1:
            # channels-first convolutions leave time as the fastest dimension; attention kernels want head_dim.
            qk = qk.contiguous()
        q, k = qk.split([nh, qk.shape[1] - nh], dim=1)
        return self.comm.tp_sum(self.o_proj(causal_attention(q, k, v.transpose(1, 2), self.scale)))


class RouterMLP(nn.Module):
    def __init__(self, size: int, classes: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(size, eps)
        self.fc1 = Linear(size, size, bias=True)
        self.fc2 = Linear(size, size, bias=True)
        self.out_proj = Linear(size, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(x))))))


class Router(nn.Module):
    """ZAYA's router: a down-projection plus the previous layer's router state (EDA), an MLP over E+1 classes
    (class E is the skip expert, which computes nothing), top-1 chosen on probabilities plus balancing biases."""

    def __init__(self, cfg: ZayaConfig, layer: int) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        r = cfg.router_hidden_size
        self.down_proj = Linear(cfg.hidden_size, r, bias=True)
        # Layer 0 has no previous router state, hence no scale for it (exactly as transformers).
        self.router_states_scale = empty_param(r) if layer > 0 else None
        self.router_mlp = RouterMLP(r, cfg.num_experts + 1, cfg.rms_norm_eps)
        # Only steers the top-1 choice, which is not differentiable: a frozen parameter (transformers has a buffer)
        # so it is listed by named_parameters() and saved with the others; a load-balancing controller may set it.
        self.balancing_biases = nn.Parameter(torch.empty(cfg.num_experts + 1, dtype=torch.float32), requires_grad=False)

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (logits ``[B, T, E+1]``, expert index ``[B*T, 1]`` with E = skip, weight ``[B*T, 1]``, next state)."""
        h = self.down_proj(x)
        if self.router_states_scale is not None and state is not None:
            h = h + state * self.router_states_scale
        logits = self.router_mlp(h)
        probs = torch.softmax(logits, dim=-1)
        biased = probs.detach().to(torch.float32) + self.balancing_biases
        index = torch.topk(biased, 1, dim=-1).indices
        weight = probs.gather(-1, index).masked_fill(index == self.num_experts, 0)
        return logits, index.reshape(-1, 1), weight.reshape(-1, 1), h


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ZayaConfig, layer: int, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.comm = comm
        self.gate = Router(cfg, layer)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, shard)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        _, index, weight, state = self.gate(x, state)
        b, t, h = x.shape
        # The routing weight scales each TP rank's partial expert output, so its gradient is a TP sum too.
        out = self.experts(self.comm.tp_enter(x).reshape(b * t, h), index, self.comm.tp_enter(weight))
        return self.comm.tp_sum(out).view(b, t, h), state


class ResidualScaling(nn.Module):
    """``(h + hb) * hs + (residual + rb) * rs``; the residual stream stays fp32."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.hidden_states_scale = empty_param(size)
        self.hidden_states_bias = empty_param(size)
        self.residual_scale = empty_param(size)
        self.residual_bias = empty_param(size)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return (h + self.hidden_states_bias) * self.hidden_states_scale + (
            residual + self.residual_bias
        ) * self.residual_scale


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ZayaConfig, layer: int, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, shard, comm)
        self.mlp = SparseMoeBlock(cfg, layer, shard, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_residual_scale = ResidualScaling(cfg.hidden_size)
        self.post_mlp_residual_scale = ResidualScaling(cfg.hidden_size)

    def forward(
        self,
        residual: torch.Tensor,
        state: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = self.input_layernorm.weight.dtype
        h = self.self_attn(self.input_layernorm(residual.to(dtype)), cos, sin, tables)
        residual = self.post_attention_residual_scale(h, residual)
        h, state = self.mlp(self.post_attention_layernorm(residual.to(dtype)), state)
        return self.post_mlp_residual_scale(h, residual), state


class ZayaModel(nn.Module):
    def __init__(self, cfg: ZayaConfig, shard: Shard, comm: Collectives) -> None:
        super().__init__()
        self.input_hidden_states_scale = empty_param(cfg.hidden_size)
        self.input_hidden_states_bias = empty_param(cfg.hidden_size)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, shard, comm)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, shard, comm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, H]`` (after the last norm)."""
        emb = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rotary_cos_sin(positions, self.rotary_dim, self.rope_theta, emb.dtype)
        tables = rotary_tables(cos, sin, self.head_dim)  # once for all layers
        h = ((emb + self.input_hidden_states_bias) * self.input_hidden_states_scale).to(torch.float32)
        state = None  # EDA: each layer's router adds the previous layer's router state
        for layer in self.layers:
            h, state = layer(h, state, cos, sin, tables)
        return self.norm(h.to(self.norm.weight.dtype))


class ZayaForCausalLM(CausalLM):
    """ZAYA1 language model: ``forward(input_ids) -> logits`` (this rank's vocabulary slice with TP)."""

    def __init__(self, cfg: ZayaConfig, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> None:
        super().__init__(cfg, ZayaModel(cfg, shard, comm), shard, comm)

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Fill parameters as the plan says (normal with the config's std, ones, zeros); balancing biases favour
        real experts over the skip expert, as transformers initialises them."""
        init_from_plan(self, param_specs(self.config), std=self.config.initializer_range, generator=generator)
        with torch.no_grad():
            for layer in self.model.layers:
                if layer.mlp.gate.balancing_biases.device.type != "meta":
                    layer.mlp.gate.balancing_biases[-1] = -1.0


def build(cfg: ZayaConfig, shard: Shard = Shard(), comm: Collectives = SINGLE_PROCESS) -> ZayaForCausalLM:
    """The model for ``cfg``, holding ``shard`` of it, with freshly initialised weights."""
    model = ZayaForCausalLM(cfg, shard, comm)
    model.init_weights()
    return model
