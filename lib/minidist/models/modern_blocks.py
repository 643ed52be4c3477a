"""The pieces newer decoders (Llama, Mixtral, DeepSeek-V3) use in place of GPT's, for the shared transformer.

``TransformerConfig`` picks them with a few fields; the defaults keep the course's GPT/BERT
blocks unchanged. Each is here so that Mixtral 8x7B and DeepSeek-V3 can be built (on the meta
device) with every parameter of the published checkpoints, and run at small sizes:

    RMSNorm            x / rms(x) · g                      d parameters (LayerNorm: 2d)
    rotary positions   ``position="rope"``: no table; Q and K rotated by position (Su et al. 2021)
    grouped-query      ``n_kv_heads`` < n_heads: K and V have n_kv_heads heads, each shared by
    attention          n_heads / n_kv_heads query heads (Ainslie et al. 2023): Mixtral 32 / 8
    SwiGLU             ``activation="swiglu"``: down(silu(gate(x)) · up(x)), three matrices
    mixture of experts ``num_experts`` > 0: ``minidist.parallel.experts.MoELayer`` in the blocks
                       from ``first_dense_layers`` on

``make_norm``, ``make_attention``, ``make_mlp`` pick the block's parts from the config (the
course's ``MultiHeadSelfAttention`` and ``MLP`` for classic configs, so their weights keep their names).
    latent attention   ``mla=MLAConfig(...)``: DeepSeek's MLA (DeepSeek-V2 report, section 2.1):
    (MLA)              Q and the joint K/V come from low-rank "latents" (q_lora_rank,
                       kv_lora_rank) with an RMSNorm on each; a separate rotary part of
                       qk_rope_head_dim per query head and ONE rotary key shared by all heads

What differs from the real models (parameters are exact; computation is simpler): DeepSeek-V3
routes with sigmoid scores and a bias for balance (aux-loss-free, 256 more numbers per layer, not
parameters of ours), in node-limited groups; we use the softmax top-k router of
``minidist.parallel.experts`` for both. RoPE here is the plain one (DeepSeek extends it with YaRN);
MLA runs without the absorbed-matrix inference trick. No sliding window, no KV cache for MLA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "MLAConfig",
    "RMSNorm",
    "rotate",
    "GroupedQueryAttention",
    "LatentAttention",
    "linear_count",
    "make_norm",
    "make_attention",
    "make_mlp",
]


@dataclass(frozen=True)
class MLAConfig:
    """Shapes of multi-head latent attention (DeepSeek-V3: 1536, 512, 128, 64, 128)."""

    q_lora_rank: int  # 0: Q straight from x (d -> heads · (nope + rope))
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight (Zhang and Sennrich 2019): LayerNorm without centring or bias."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary positions on (B, H, T, dim): pairs (i, i + dim/2) turned by position · theta^(-2i/dim).

    The score q_t · k_s then depends on t and s only through t - s.
    """
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    angles = torch.arange(seq, device=x.device, dtype=torch.float64)[:, None] * freqs  # (T, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def linear_count(d_in: int, d_out: int, bias: bool) -> int:
    return d_in * d_out + (d_out if bias else 0)


def _attend(q, k, v, bias):
    """softmax(q kᵀ / √d_qk + bias) v over (B, H, T, ·), heads concatenated: (B, T, H · d_v)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class GroupedQueryAttention(nn.Module):
    """Attention with ``n_kv_heads`` K/V heads (= n_heads: ordinary multi-head), rotary or not.

    Parameters: Q and output d·d each, K and V d·(n_kv_heads · d/n_heads) each (+ biases).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, hd
        self.rope_theta = cfg.rope_theta if cfg.position == "rope" else None
        self.query = nn.Linear(d, cfg.n_heads * hd, bias=cfg.bias)
        self.key = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.bias)
        self.value = nn.Linear(d, self.n_kv_heads * hd, bias=cfg.bias)
        self.output = nn.Linear(cfg.n_heads * hd, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.query(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope_theta is not None:
            q, k = rotate(q, self.rope_theta), rotate(k, self.rope_theta)
        group = self.n_heads // self.n_kv_heads  # query heads per K/V head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.output(_attend(q, k, v, bias))


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA); names follow the released checkpoint's.

        x ─► q_a (d → q_lora) ─► RMSNorm ─► q_b (→ H·(nope+rope))       queries
        x ─► kv_a (d → kv_lora + rope) ─► [latent c ─► RMSNorm ─► kv_b (→ H·(nope+v))] + [shared rope key]
        heads: q = [q_nope, rot(q_rope)], k = [k_nope, rot(k_rope)]; out = o (H·v → d)

    Only c (kv_lora_rank numbers) and the rope key need caching per token: the point of MLA.
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        m: MLAConfig = cfg.mla
        d, h, bias = cfg.hidden_size, cfg.n_heads, cfg.bias
        self.m, self.n_heads, self.rope_theta = m, h, cfg.rope_theta
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a = nn.Linear(d, m.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(m.q_lora_rank)
            self.q_b = nn.Linear(m.q_lora_rank, h * qk, bias=bias)
        else:
            self.q_proj = nn.Linear(d, h * qk, bias=bias)
        self.kv_a = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=bias)
        self.kv_norm = RMSNorm(m.kv_lora_rank)
        self.kv_b = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=bias)
        self.output = nn.Linear(h * m.v_head_dim, d, bias=bias)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m, (b, t, _), h = self.m, x.shape, self.n_heads
        q = self.q_b(self.q_norm(self.q_a(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(b, t, h, -1).transpose(1, 2)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, t, h, -1).transpose(1, 2)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rope = rotate(k_rope.unsqueeze(1), self.rope_theta).expand(b, h, t, m.qk_rope_head_dim)
        q = torch.cat((q_nope, rotate(q_rope, self.rope_theta)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        return self.output(_attend(q, k, v, bias))

    @staticmethod
    def parameter_count(cfg) -> int:
        m, d, h, bias = cfg.mla, cfg.hidden_size, cfg.n_heads, cfg.bias
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = (
                linear_count(d, m.q_lora_rank, bias)
                + m.q_lora_rank
                + linear_count(m.q_lora_rank, h * qk, bias)
            )
        else:
            q = linear_count(d, h * qk, bias)
        kv = linear_count(d, m.kv_lora_rank + m.qk_rope_head_dim, bias) + m.kv_lora_rank
        kv += linear_count(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias)
        return q + kv + linear_count(h * m.v_head_dim, d, bias)


def make_norm(cfg) -> nn.Module:
    """LayerNorm, or RMSNorm (``cfg.norm``)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


def make_attention(cfg) -> nn.Module:
    """The course's attention for classic configs; grouped-query / rotary or latent (MLA) otherwise."""
    if cfg.mla is not None:
        return LatentAttention(cfg)
    if cfg.kv_heads != cfg.n_heads or cfg.position == "rope" or not cfg.bias:
        return GroupedQueryAttention(cfg)
    from minidist.models.transformer import MultiHeadSelfAttention  # (that module imports this one)

    return MultiHeadSelfAttention(cfg)


def make_mlp(cfg, layer: int = 0) -> nn.Module:
    """Block ``layer``'s feed-forward: the MLP, a SwiGLU FFN, or a ``MoELayer`` (``cfg.is_moe_layer``)."""
    if cfg.activation == "gelu" and cfg.bias and not cfg.is_moe_layer(layer):
        from minidist.models.transformer import MLP  # (that module imports this one)

        return MLP(cfg)
    from minidist.parallel.experts import ExpertFFN, MoELayer  # only MoE/SwiGLU configs load them

    if cfg.is_moe_layer(layer):
        return MoELayer(
            cfg.hidden_size,
            cfg.moe_d_ffn or cfg.ffn_size,
            cfg.num_experts,
            top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
            activation=cfg.activation,
            bias=cfg.bias,
            num_shared_experts=cfg.num_shared_experts,
        )
    return ExpertFFN(cfg.hidden_size, cfg.ffn_size, cfg.activation, cfg.bias)
