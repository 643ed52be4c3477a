"""What is added to the attention scores before the softmax: positions, causality, padding.

``MultiHeadSelfAttention`` computes softmax(Q Kᵀ / √d_head + bias) V; the bias is where a
transformer learns nothing and is simply told things, as one (B or 1, H or 1, T, T) tensor:

    ALiBi (Press et al., 2022)   -slope_h · |i - j|: farther keys cost more, a slope per head
                                 (``alibi_slopes``); BLOOM's positions, instead of a table
    causal mask                  a very negative number where key j > query i (decoders)
    padding mask                 the same where ``attention_mask[b, j] == 0``

``attention_bias`` builds all T rows for ``transformer.Transformer``; ``generate.step_bias``
builds only the rows of new tokens for decoding with a KV cache.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformer.py imports this module: the config is needed for annotations only
    from minidist.models.transformer import TransformerConfig

__all__ = ["alibi_slopes", "attention_bias"]


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al., 2022): a geometric sequence 2^(-8/n), 2^(-16/n), ...

    For n a power of two, head h (1-based) gets 2^(-8h/n). Otherwise take the n' = largest power
    of two below n, use its n' slopes, and fill the rest with every other slope of the 2n'
    sequence (the ones that fall between) -- BLOOM's 112 heads use 64 + 48 this way.
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be positive, got {n_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    base = 2 ** math.floor(math.log2(n_heads))
    slopes = geometric(base)
    if base < n_heads:
        slopes += geometric(2 * base)[0::2][: n_heads - base]
    return torch.tensor(slopes)


def attention_bias(
    cfg: TransformerConfig,
    seq_len: int,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The additive bias on attention scores, broadcastable to (B, n_heads, T, T), or None.

    Three parts, summed: ALiBi distances (``-slope * (i - j)``), the causal mask (a very negative
    number where key j > query i), and the padding mask (where ``attention_mask[b, j] == 0``).
    We use ``finfo.min`` rather than -inf so that a row with every key masked gives a uniform
    softmax instead of NaN.
    """
    bias = None
    positions = torch.arange(seq_len, device=device)
    distance = positions[:, None] - positions[None, :]  # (T, T): i - j
    if cfg.position == "alibi":
        slopes = alibi_slopes(cfg.n_heads).to(device=device, dtype=dtype)
        # Without the causal mask, keys after the query would get a bonus; |i - j| treats both ways alike.
        bias = -slopes[:, None, None] * distance.abs().to(dtype)[None]  # (H, T, T)
        bias = bias[None]
    very_negative = torch.finfo(dtype).min
    if cfg.causal:
        causal = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
        causal.masked_fill_(distance < 0, very_negative)
        bias = causal[None, None] if bias is None else bias + causal
    if attention_mask is not None:
        if attention_mask.shape[-1] != seq_len:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[-1]} positions, input_ids has {seq_len}: "
                "pass a (batch, seq_len) mask with 1 for real tokens and 0 for padding"
            )
        pad = torch.zeros(attention_mask.shape, dtype=dtype, device=device)
        pad.masked_fill_(attention_mask == 0, very_negative)
        pad = pad[:, None, None, :]  # (B, 1, 1, T): masks keys
        bias = pad if bias is None else bias + pad
    if bias is not None:
        # Sums of two finfo.min overflow to -inf; clamp keeps every entry finite.
        bias = bias.clamp(min=very_negative)
    return bias
