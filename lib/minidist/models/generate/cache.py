"""The KV cache, and one step of a layer that uses it: attention for the new tokens only.

In a causal model position j only looks at positions <= j, so the keys and values of old
positions never change. The cache keeps, for every layer, the keys and values of all positions
seen so far; each step computes q, k, v for the *new* token only::

    step t (one layer, one head; T = t tokens already in the cache)

        x_t ──► q_t = x_t W_q                                  the new token's query
            ──► k_t = x_t W_k ─┐                               its key and value
            ──► v_t = x_t W_v ─┤
                               ▼
        cache  K: [k_0 k_1 ... k_{t-1}] + k_t  ──►  [k_0 ... k_t]     (B, H, T+1, d_head)
               V: [v_0 v_1 ... v_{t-1}] + v_t  ──►  [v_0 ... v_t]
                               │
        scores = q_t [k_0 ... k_t]ᵀ / √d_head + bias[t, 0..t]          (B, H, 1, T+1)
        out_t  = softmax(scores) [v_0 ... v_t] ──► W_o                 (B, 1, d)

    The MLP, the LayerNorms and the residuals act on each position alone, so they run on
    the new token only as well.

    KVCache          (keys, values) per layer, each (B, H, T_past, d_head)
    attention_step   one MultiHeadSelfAttention on new tokens, given the layer's past keys/values
    block_step       one TransformerBlock (pre-LN or post-LN) around it
    step_bias        rows past..past+new of the causal (+ ALiBi) bias the full forward uses

The sibling ``decode`` runs these through the whole model; ``cost`` counts what they save.
"""

from __future__ import annotations

import math

import torch

from minidist.models.score_bias import alibi_slopes
from minidist.models.transformer import MultiHeadSelfAttention, TransformerBlock, TransformerConfig

__all__ = ["KV", "KVCache", "attention_step", "block_step", "step_bias"]

KV = tuple[torch.Tensor, torch.Tensor]


class KVCache:
    """The keys and values of every past position, per layer: ``cache[i] = (keys, values)``.

    Each is (B, H, T_past, d_head); an entry is None until the layer has seen a token. The
    cache is a plain mutable sequence of these entries, so ``span_step`` can fill any list of
    per-layer entries (a swarm server keeps one list per session for its span of blocks).
    """

    def __init__(self, n_layers: int) -> None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be positive, got {n_layers}")
        self.layers: list[KV | None] = [None] * n_layers

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> KV | None:
        return self.layers[i]

    def __setitem__(self, i: int, entry: KV | None) -> None:
        self.layers[i] = entry

    def __iter__(self):  # noqa: ANN204
        return iter(self.layers)

    @property
    def length(self) -> int:
        """Positions cached so far (T_past); every filled layer must agree."""
        lengths = {kv[0].shape[2] for kv in self.layers if kv is not None}
        if len(lengths) > 1:
            raise ValueError(
                f"layers of this cache hold different lengths {sorted(lengths)}: a step was cut short"
            )
        return lengths.pop() if lengths else 0

    @property
    def batch_size(self) -> int | None:
        """Sequences in the cache (B), or None while it is empty."""
        filled = [kv for kv in self.layers if kv is not None]
        return filled[0][0].shape[0] if filled else None

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values (measured from the tensors)."""
        return sum(t.numel() * t.element_size() for kv in self.layers if kv is not None for t in kv)

    def __repr__(self) -> str:
        return f"KVCache(n_layers={len(self)}, length={self.length}, nbytes={self.nbytes})"


def attention_step(
    attn: MultiHeadSelfAttention,
    x_new: torch.Tensor,
    past_kv: KV | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, KV]:
    """Attention of T_new new positions over past and new keys: ``(out, (keys, values))``.

    ``x_new`` (B, T_new, d); ``past_kv`` the layer's cached (keys, values), each
    (B, H, T_past, d_head), or None for the first step; ``bias`` broadcastable to
    (B, H, T_new, T_past + T_new) (``step_bias``). Returns the output (B, T_new, d) and the
    keys and values of *all* T_past + T_new positions: the layer's new cache entry.

    The same arithmetic as ``MultiHeadSelfAttention.forward``, except that keys and values of
    earlier positions come from the cache instead of being recomputed.
    """
    batch, new_len, d = x_new.shape
    q = attn.split_heads(attn.query(x_new))  # (B, H, T_new, d_head)
    k = attn.split_heads(attn.key(x_new))
    v = attn.split_heads(attn.value(x_new))
    if past_kv is not None:
        past_k, past_v = past_kv
        # the cache must match everywhere but in its length (dim 2): same B, H, d_head
        expected = (batch, k.shape[1], past_k.shape[2] if past_k.dim() == 4 else -1, k.shape[3])
        if past_k.shape != expected or past_v.shape != expected:
            raise ValueError(
                f"cached keys have shape {tuple(past_k.shape)}, values {tuple(past_v.shape)} "
                f"(B, H, T_past, d_head), new keys "
                f"{tuple(k.shape)}: the cache belongs to another batch or model; start a new KVCache"
            )
        k = torch.cat([past_k, k], dim=2)  # append the new positions: (B, H, T_past + T_new, d_head)
        v = torch.cat([past_v, v], dim=2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim)  # (B, H, T_new, T_past + T_new)
    if bias is not None:
        scores = scores + bias
    weights = attn.attn_dropout(torch.softmax(scores, dim=-1))
    out = (weights @ v).transpose(1, 2).reshape(batch, new_len, d)
    return attn.output(out), (k, v)


def block_step(
    block: TransformerBlock, x_new: torch.Tensor, past_kv: KV | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor, KV]:
    """``TransformerBlock.forward`` for new positions only: ``(x, (keys, values))``.

    LayerNorms, the MLP and the residual additions act on each position alone, so only the
    attention needs the past (``attention_step``).
    """
    if block.pre_ln:
        attended, kv = attention_step(block.attention, block.attention_norm(x_new), past_kv, bias)
        x = x_new + block.dropout(attended)
        return x + block.dropout(block.mlp(block.mlp_norm(x))), kv
    attended, kv = attention_step(block.attention, x_new, past_kv, bias)
    x = block.attention_norm(x_new + block.dropout(attended))
    return block.mlp_norm(x + block.dropout(block.mlp(x))), kv


def step_bias(
    cfg: TransformerConfig, past_len: int, new_len: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    """Rows past_len..past_len+new_len of ``transformer.attention_bias`` for past_len + new_len keys.

    Query i (absolute position past_len + row) may see key j when j <= i (``cfg.causal``), and
    with ALiBi pays ``slope_h · |i - j|``. Shape (1, H or 1, new_len, past_len + new_len), or
    None when the config has neither a causal mask nor ALiBi. Built for the new rows only:
    O(new · total) work, not the full (total, total) matrix.
    """
    if past_len < 0 or new_len < 1:
        raise ValueError(f"need past_len >= 0 and new_len >= 1, got past_len={past_len}, new_len={new_len}")
    queries = torch.arange(past_len, past_len + new_len, device=device)
    keys = torch.arange(past_len + new_len, device=device)
    distance = queries[:, None] - keys[None, :]  # (T_new, T_total): i - j
    bias = None
    if cfg.position == "alibi":
        slopes = alibi_slopes(cfg.n_heads).to(device=device, dtype=dtype)
        bias = (-slopes[:, None, None] * distance.abs().to(dtype)[None])[None]  # (1, H, T_new, T_total)
    very_negative = torch.finfo(dtype).min
    if cfg.causal:
        causal = torch.zeros(distance.shape, dtype=dtype, device=device)
        causal.masked_fill_(distance < 0, very_negative)  # keys after the query
        bias = causal[None, None] if bias is None else bias + causal
    if bias is not None:
        bias = bias.clamp(min=very_negative)  # as attention_bias: finite everywhere
    return bias
