"""Assignment 6: fewer bytes per weight, and one token at a time -- quantization and a KV cache.

A 176B-parameter model is 352 GB in fp16. Two tricks make such a model usable on few machines:

**Quantization** stores each weight in 8 or 4 bits plus a floating-point *scale* shared by a
group of weights, and multiplies with the weight rebuilt ("dequantized") on the fly::

    format        bits per weight                      176B weights
    fp16          16                                   352 GB
    int8          8   + one fp32 scale per row         176 GB
    nf4           4   + one fp32 scale per block of 64  ~ 99 GB  (88 GB for the codes alone)

**A KV cache** makes generation cost O(T) per new token instead of O(T^2): generating token
t+1 needs the keys and values of tokens 0..t, which do not change once computed. Keep them;
each step projects only the new token and appends its key and value::

    without a cache                          with a cache
    step 1: project tokens 0..T0-1           step 1: project tokens 0..T0-1, keep K, V
    step 2: project tokens 0..T0    again    step 2: project token T0 only, append to K, V
    step 3: project tokens 0..T0+1  again    step 3: project token T0+1 only, append ...

=====  ===================================  =================================================
task   where                                what it does
=====  ===================================  =================================================
1      ``quantize_int8``/``dequantize_int8`` absmax int8, one scale per row
2      ``pack_4bit``/``unpack_4bit``        two 4-bit codes per byte, the first in the high half
3      ``quantize_nf4``/``dequantize_nf4``  4-bit NormalFloat, one absmax per block
4      ``attention_step``                   causal multi-head attention for new tokens, with a cache
5      ``decoder_step``/``generate``        the decoder one step at a time; greedy generation
=====  ===================================  =================================================

The course library's quantization (``minidist.quant``) and generation (``minidist.models
.generate``), torch's quantization (``torch.ao``, ``torch.quantize_per_*``), its fused
attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``) and bitsandbytes are
off limits: the grader refuses a submission that uses them. Plain torch is yours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "NF4_VALUES",
    "NF4Weight",
    "TinyDecoder",
    "attention_step",
    "decoder_step",
    "dequantize_int8",
    "dequantize_nf4",
    "generate",
    "pack_4bit",
    "quantize_int8",
    "quantize_nf4",
    "unpack_4bit",
]

# --- given: the 16 NF4 code values --------------------------------------------------------------
#: The 16 values of 4-bit NormalFloat (QLoRA, Dettmers et al. 2023), ascending. Weights of a
#: trained network are roughly normal, so the values sit at quantiles of N(0, 1) (scaled into
#: [-1, 1]) rather than evenly spaced: more of them near 0, where most weights are. Index 7 is
#: exactly 0 (zero weights stay zero), index 0 is -1, index 15 is 1.
NF4_VALUES = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


# --- task 1: absmax int8 ------------------------------------------------------------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 with one scale per row (a row: the last dimension).

    For each row: ``scale = max |w| / 127``; ``code = round(w / scale)``, clamped to
    [-127, 127] (-128 is not used: -w then quantizes to -code). A row of zeros gets scale 0 and
    codes 0 -- never a division by zero::

        row    [0.5, -2.54, 1.0]      max |w| = 2.54,  scale = 0.02
        codes  [25, -127, 50]         int8
        back   codes * scale = [0.5, -2.54, 1.0]      error at most scale / 2 per weight

    Compute in float32 whatever ``w``'s dtype. Returns ``(codes, scale)``: ``codes`` int8 of
    ``w``'s shape, ``scale`` float32 of shape ``(..., 1)`` (the row dimension kept, so that
    ``codes * scale`` broadcasts). Memory: one byte per weight plus 4 per row.
    """
    # TODO(task 1): torch.round rounds halves to even; that is fine.
    ### BEGIN SOLUTION TODO(task 1): write quantize_int8
    w32 = w.float()
    scale = w32.abs().amax(dim=-1, keepdim=True) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w32 / safe).clamp(-127, 127).to(torch.int8)
    return codes, scale
    ### END SOLUTION


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` as float32: the weights ``quantize_int8`` stored, up to rounding."""
    ### BEGIN SOLUTION TODO(task 1): write dequantize_int8
    return codes.float() * scale
    ### END SOLUTION


# --- task 2: two 4-bit codes per byte -------------------------------------------------------------
def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (any integer dtype, any shape, an even number of them) -> uint8 bytes,
    two codes per byte: flattened, code 2i in the *high* four bits of byte i, code 2i+1 in the
    low four bits::

        codes [3, 12, 7, 0]   ->   bytes [3 * 16 + 12, 7 * 16 + 0] = [60, 112]

    Returns a 1-D uint8 tensor of ``codes.numel() // 2`` elements. ValueError for an odd number
    of codes (say how many) or a code outside [0, 15].
    """
    ### BEGIN SOLUTION TODO(task 2): write pack_4bit
    if codes.numel() % 2:
        raise ValueError(f"pack_4bit needs an even number of codes, got {codes.numel()}")
    pairs = codes.reshape(-1, 2).long()
    if ((pairs < 0) | (pairs > 15)).any():
        raise ValueError("pack_4bit: every code must lie in [0, 15]")
    return (pairs[:, 0] * 16 + pairs[:, 1]).to(torch.uint8)
    ### END SOLUTION


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_4bit``: a uint8 tensor of n bytes -> the 2n codes (uint8), in order
    (for each byte its high four bits, then its low four bits)."""
    ### BEGIN SOLUTION TODO(task 2): write unpack_4bit
    flat = packed.reshape(-1)
    return torch.stack([flat // 16, flat % 16], dim=1).reshape(-1)
    ### END SOLUTION


# --- task 3: NF4 ------------------------------------------------------------------------------------
@dataclass
class NF4Weight:
    """A tensor in NF4 (given): what ``quantize_nf4`` returns and ``dequantize_nf4`` reads.

    packed   uint8, 1-D, (number of blocks x block / 2) bytes: the codes, two per byte
    scales   float32, 1-D, one absmax per block
    shape    the original tensor's shape (a tuple of ints)
    block    how many weights share a scale (even)

    Nothing else: the grader measures the bytes of every tensor this object holds.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    block: int

    @property
    def numel(self) -> int:
        """How many weights the tensor had (the padding not counted)."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors: the packed codes and the scales."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


def quantize_nf4(w: torch.Tensor, block: int = 64) -> NF4Weight:
    """Block-wise NF4 (QLoRA's 4-bit NormalFloat, without double quantization).

    Flatten ``w`` (float32), pad it with zeros to a whole number of blocks, and per block of
    ``block`` weights::

        absmax = max |w|                      block [0.2, -0.8, 0.4, 0.05]      absmax 0.8
        n      = w / absmax   in [-1, 1]      n     [0.25, -1, 0.5, 0.0625]
        code   = the index of the NF4 value nearest to n
                                              codes [10, 0, 12, 8]  (0.246, -1, 0.441, 0.080)
        back   = NF4_VALUES[code] * absmax    [0.197, -0.8, 0.353, 0.064]

    A block of zeros has absmax 0: its codes are 7 (the value 0), never a division by zero.
    The codes are packed with ``pack_4bit`` (padding included: its codes are stored too).

    Memory: ``blocks * block / 2`` bytes of codes plus ``4 * blocks`` of scales -- 4.5 bits
    per weight for ``block = 64``. ValueError for an odd or non-positive ``block`` or an empty
    ``w``.
    """
    # TODO(task 3): the nearest of 16 values: the smallest |n - value|, or torch.bucketize on
    # the midpoints between neighbouring values.
    ### BEGIN SOLUTION TODO(task 3): write quantize_nf4
    if block <= 0 or block % 2:
        raise ValueError(f"block must be a positive even number (two codes per byte), got {block}")
    if w.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    flat = w.detach().reshape(-1).float()
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)])
    blocks = flat.reshape(-1, block)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    normed = blocks / safe[:, None]
    values = torch.tensor(NF4_VALUES)
    codes = (normed[..., None] - values).abs().argmin(dim=-1)
    return NF4Weight(pack_4bit(codes), absmax, tuple(w.shape), block)
    ### END SOLUTION


def dequantize_nf4(q: NF4Weight) -> torch.Tensor:
    """NF4 -> float32 of ``q.shape``: ``NF4_VALUES[code] * scales[block of that code]``, the
    padding dropped."""
    ### BEGIN SOLUTION TODO(task 3): write dequantize_nf4
    codes = unpack_4bit(q.packed).long().reshape(-1, q.block)
    values = torch.tensor(NF4_VALUES)[codes] * q.scales.float()[:, None]
    return values.reshape(-1)[: q.numel].reshape(q.shape)
    ### END SOLUTION


# --- task 4: attention for new tokens, with a cache ---------------------------------------------------
def attention_step(q_proj, k_proj, v_proj, o_proj, n_heads: int, x_new: torch.Tensor, past_kv=None):
    """Causal multi-head self-attention for the new tokens ``x_new`` (B, T_new, d), given the keys
    and values of the tokens before them (``past_kv``: ``(k, v)``, each (B, n_heads, T_past,
    d / n_heads), or None when there are none).

    ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` are the layer's projections (d -> d): call
    them (``q_proj(x)``); do not read their weights. Call each on the **new tokens only**: that
    is what the cache is for. Then, with ``h = d / n_heads`` and the heads split as
    ``(B, T, d) -> (B, n_heads, T, h)`` (head i: features ``i h .. (i+1) h - 1``)::

        k = past k ++ k_proj(x_new)            along the tokens: (B, n_heads, T_past + T_new, h)
        v = past v ++ v_proj(x_new)
        scores = q kᵀ / √h                     (B, n_heads, T_new, T_past + T_new)
        new token i sits at position T_past + i: it sees keys 0 .. T_past + i (causal), no later one
        out = o_proj(softmax(scores) v, heads joined back to (B, T_new, d))

    Returns ``(out, (k, v))``: the output for the new tokens and the cache grown by them (the
    past keys and values first, unchanged). With ``past_kv=None`` and the whole sequence as
    ``x_new`` this is ordinary causal attention.
    """
    ### BEGIN SOLUTION TODO(task 4): write attention_step
    batch, new, d = x_new.shape
    h = d // n_heads

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, new, n_heads, h).transpose(1, 2)

    q, k, v = split(q_proj(x_new)), split(k_proj(x_new)), split(v_proj(x_new))
    if past_kv is not None:
        k = torch.cat([past_kv[0], k], dim=2)
        v = torch.cat([past_kv[1], v], dim=2)
    past = k.shape[2] - new
    scores = q @ k.transpose(-1, -2) / math.sqrt(h)
    query_at = past + torch.arange(new, device=x_new.device)
    key_at = torch.arange(past + new, device=x_new.device)
    scores = scores.masked_fill(key_at[None, :] > query_at[:, None], float("-inf"))
    mixed = torch.softmax(scores, dim=-1) @ v
    return o_proj(mixed.transpose(1, 2).reshape(batch, new, d)), (k, v)
    ### END SOLUTION


# --- given: a small decoder -----------------------------------------------------------------------
class DecoderBlock(nn.Module):
    """Pre-LN: ``x = x + o(attention(norm1(x)))``, then ``x = x + mlp(norm2(x))`` (given)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyDecoder(nn.Module):
    """A GPT-like decoder (given): what ``decoder_step`` and ``generate`` run. The grader runs them
    on a decoder of its own with these same attributes (other sizes)::

        word      nn.Embedding(vocab, d)        the token vectors
        position  nn.Embedding(positions, d)    learned positions: token t gets position(t)
        blocks    DecoderBlocks (norm1, q, k, v, o, norm2, mlp)
        norm      the final LayerNorm
        head      nn.Linear(d, vocab)           logits
        n_heads   heads per attention
    """

    def __init__(
        self, vocab: int, d: int, n_heads: int, n_layers: int, positions: int, seed: int = 0
    ) -> None:
        super().__init__()
        if d % n_heads:
            raise ValueError(f"d = {d} is not divisible by n_heads = {n_heads}")
        torch.manual_seed(seed)
        self.n_heads = n_heads
        self.word = nn.Embedding(vocab, d)
        self.position = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(DecoderBlock(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)


# --- task 5: the decoder one step at a time, and greedy generation -------------------------------
def decoder_step(model, input_ids: torch.Tensor, past=None):
    """Run ``model`` on the tokens ``input_ids`` (B, T) that follow the cached ones.

    ``past`` is None (nothing cached: the tokens start at position 0) or the list that the
    previous call returned: one ``(k, v)`` per block, each (B, n_heads, T_past, h); the new
    tokens then sit at positions T_past .. T_past + T - 1. For each block, in order::

        x = word(ids) + position(their positions)
        a, kv = attention_step(block.q, block.k, block.v, block.o, n_heads, block.norm1(x), its past)
        x = x + a
        x = x + block.mlp(block.norm2(x))
        logits = head(norm(x))

    Returns ``(logits, kvs)``: logits (B, T, vocab) for the new tokens and the list of every
    block's grown ``(k, v)``.
    """
    ### BEGIN SOLUTION TODO(task 5): write decoder_step
    start = 0 if past is None else past[0][0].shape[2]
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
    x = model.word(input_ids) + model.position(positions)[None]
    kvs = []
    for index, block in enumerate(model.blocks):
        cached = None if past is None else past[index]
        a, kv = attention_step(block.q, block.k, block.v, block.o, model.n_heads, block.norm1(x), cached)
        x = x + a
        mlp_in = block.norm2(x)
        x = x + block.mlp(mlp_in)
        kvs.append(kv)
    return model.head(model.norm(x)), kvs
    ### END SOLUTION


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
    """Greedy decoding: append, ``max_new_tokens`` times, the token with the largest logit after
    the last position. Returns (B, T + max_new_tokens) token ids (int64), the prompt first.

    ``use_cache=False``: every step runs ``decoder_step`` on the whole sequence so far (no past)
    -- O(T) projections per step, O(T^2) in all. ``use_cache=True``: the first step runs the
    prompt and keeps the cache; every later step runs **only the token just generated** with
    the cache -- one token through every projection per step. Both give the same tokens.
    """
    ### BEGIN SOLUTION TODO(task 5): write generate
    ids, past = input_ids, None
    for _ in range(max_new_tokens):
        if not use_cache:
            logits, _ = decoder_step(model, ids)
        elif past is None:
            logits, past = decoder_step(model, ids)
        else:
            logits, past = decoder_step(model, ids[:, -1:], past)
        ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids
    ### END SOLUTION
