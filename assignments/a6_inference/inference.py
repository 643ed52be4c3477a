"""Assignment 6: fewer bytes per weight, and one token at a time -- quantization and a KV cache.

A 176B-parameter model is 352 GB in fp16. Two tricks make such a model usable on few machines:

**Quantization** stores each weight as a small integer code plus a floating-point *scale*
shared by a group of weights, and rebuilds ("dequantizes") the weight when it multiplies: 176B
weights take 352 GB in fp16, 176 GB in int8 with a scale per row, about 99 GB in NF4 with a scale
per block of 64 (lecture 9, section 3; Dettmers et al. 2022, LLM.int8(), sections 2.1 and 3; Dettmers
et al. 2023, QLoRA, section 3).

**A KV cache** keeps the keys and values of the tokens already seen, which do not change, so that
each generation step projects only the new token: O(T) work per new token instead of O(T^2)
(lecture 9, section 5; Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2).

=====  ========================================  ===============================================
task   where                                     what it does
=====  ========================================  ===============================================
1      ``quantize_int8`` ... ``dequantize_nf4``  int8 per row, 4-bit packing, NF4 per block
2      ``attention_step``                        causal attention for new tokens, with a cache
3      ``decoder_step``/``generate``             the decoder a step at a time; greedy generation
4      ``quantize_model``                        your own format for a model, graded on its bits
=====  ========================================  ===============================================

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
    "Quantized",
    "TinyDecoder",
    "attention_step",
    "decoder_step",
    "dequantize_int8",
    "dequantize_nf4",
    "generate",
    "pack_4bit",
    "quantize_int8",
    "quantize_model",
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


# --- task 1: weights in fewer bits: int8 per row, 4-bit packing, NF4 per block -------------------
def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 with one scale per row (a row: the last dimension): lecture 9
    section 3.1; LLM.int8() sections 2.1 (absmax) and 3.1 (a scale per row, "vector-wise").

    Contract: ``(codes, scale)``, ``codes`` int8 of ``w``'s shape in [-127, 127] (symmetric: -w
    gives -codes), ``scale`` float32 of shape ``(..., 1)`` so that ``codes * scale`` broadcasts
    back to ``w`` within half a step; the largest weight of a row maps to +-127, and a row of
    zeros to codes 0 and scale 0. Any float dtype in, float32 arithmetic. Cost: one byte per
    weight plus 4 per row.
    """
    # TODO(task 1): what must a row of zeros give, and how do you get it without dividing by zero?
    raise NotImplementedError("TODO(task 1): write quantize_int8")


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` as float32: the weights ``quantize_int8`` stored, up to rounding."""
    raise NotImplementedError("TODO(task 1): write dequantize_int8")


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] (any integer dtype, any shape, an even number of them) -> a 1-D uint8
    tensor of ``codes.numel() // 2`` bytes: in flattened order, code 2i in the *high* four bits
    of byte i, code 2i+1 in the low four bits (the format the grader reads). ValueError for an
    odd number of codes (say how many) or a code outside [0, 15].
    """
    raise NotImplementedError("TODO(task 1): write pack_4bit")


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_4bit``: a uint8 tensor of n bytes -> the 2n codes (uint8), in order
    (for each byte its high four bits, then its low four bits)."""
    raise NotImplementedError("TODO(task 1): write unpack_4bit")


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
    """Block-wise NF4 without double quantization: lecture 9 section 3.3; QLoRA sections 2
    ("block-wise k-bit quantization") and 3 ("4-bit NormalFloat").

    Contract: the weights in flattened order, padded with zeros to whole blocks of ``block``;
    each block stores its absmax (float32) and, per weight, the index of the ``NF4_VALUES`` entry
    nearest to the weight divided by that absmax, packed by ``pack_4bit`` (the padding's codes
    too). A block of zeros keeps the code of 0. Cost: ``blocks * block / 2`` bytes of codes plus
    4 bytes a block, and nothing else (the grader measures the storages). ValueError for an odd
    or non-positive ``block`` or an empty ``w``.
    """
    # TODO(task 1): how do you find the nearest of 16 values for every weight at once, without a
    # Python loop over weights? What must the padding's codes be so that it dequantizes to 0?
    raise NotImplementedError("TODO(task 1): write quantize_nf4")


def dequantize_nf4(q: NF4Weight) -> torch.Tensor:
    """NF4 -> float32 of ``q.shape``: each weight is its code's value times its block's scale,
    the padding dropped -- what the codes hold, read from ``q`` alone."""
    raise NotImplementedError("TODO(task 1): write dequantize_nf4")


# --- task 2: attention for new tokens, with a cache ---------------------------------------------------
def attention_step(q_proj, k_proj, v_proj, o_proj, n_heads: int, x_new: torch.Tensor, past_kv=None):
    """Causal multi-head self-attention (scaled dot product, Vaswani et al. 2017 section 3.2) for
    the new tokens ``x_new`` (B, T_new, d) that follow the cached ones: lecture 9 section 5.

    ``past_kv`` is None or ``(k, v)``, each (B, n_heads, T_past, h) with ``h = d / n_heads``; head
    i owns features ``i h .. (i+1) h - 1``. The projections (d -> d) are to be called, not read,
    and each **once, on the new tokens only** (the grader counts the rows they receive). New token
    i sits at position T_past + i and attends to every position up to its own, none later.

    Returns ``(out, (k, v))``: ``out`` (B, T_new, d) after ``o_proj``, equal to the last T_new rows
    of causal attention over the whole sequence; the cache grown by the new tokens, past first and
    unchanged. Cost: O(T_new d^2) for the projections, O(T_new (T_past + T_new) d) for the scores.
    """
    # TODO(task 2): which positions may new token i see, and how does that mask look when
    # T_new > 1? What shape must the cache have so that the next call can append to it?
    raise NotImplementedError("TODO(task 2): write attention_step")


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


# --- task 3: the decoder one step at a time, and greedy generation -------------------------------
def decoder_step(model, input_ids: torch.Tensor, past=None):
    """Run the given ``TinyDecoder`` (its layout: ``DecoderBlock``, pre-LN) on the tokens
    ``input_ids`` (B, T) that follow the cached ones, through ``attention_step``.

    ``past`` is None (nothing cached) or the list the previous call returned, one ``(k, v)`` per
    block. Contract: ``(logits, kvs)`` with logits (B, T, vocab) equal to the last T positions of
    the model (as ``TinyDecoder`` and ``DecoderBlock`` describe it) run on the whole sequence,
    and ``kvs`` every block's grown cache, in block order. Cost: the new tokens only through
    every projection.
    """
    # TODO(task 3): at which positions do the new tokens sit, and where can you read how many
    # tokens are cached? Which input does each block's attention get: x, or x normalised?
    raise NotImplementedError("TODO(task 3): write decoder_step")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, use_cache: bool = True) -> torch.Tensor:
    """Greedy decoding: append, ``max_new_tokens`` times, the token with the largest logit after
    the last position. Returns (B, T + max_new_tokens) token ids (int64), the prompt first.

    ``use_cache=False`` runs the whole sequence so far at every step: O(T) tokens through the
    projections per step. ``use_cache=True`` runs the prompt once, then exactly one token per
    sequence per step (the grader counts). Both give the same tokens.
    """
    # TODO(task 3): what does the cache hold after the prompt, and which token is the only one
    # the next step has not seen?
    raise NotImplementedError("TODO(task 3): write generate")


# --- task 4: your own format for a whole model, graded on its bits -------------------------------
@dataclass
class Quantized:
    """One weight matrix in the format the grader reads (given). The grader rebuilds the weight
    from these fields alone, with its own code::

        value(code) = values[code]             (values: float16, 2**bits entries: a codebook)
                    = code - (2**(bits-1) - 1)  (values None: evenly spaced integers)
        weight      = value(code) * scale of its block, in flattened order, padding dropped

    codes    uint8, 1-D, one per weight of the flattened matrix padded to whole blocks, each < 2**bits
    bits     1 .. 8: each code counts ``bits`` bits (as if packed)
    values   float16 of 2**bits entries (16 bits each), or None (free)
    scales   one per block: float16 or float32 (16 or 32 bits each), or itself a ``Quantized``
             of the scales (double quantization: QLoRA section 3)
    block    how many consecutive weights share a scale
    shape    the matrix's shape

    Its bits: the codes' plus the values' plus the scales' (recursively). Nothing else counts,
    and nothing else is read.
    """

    codes: torch.Tensor
    bits: int
    values: torch.Tensor | None
    scales: torch.Tensor | Quantized
    block: int
    shape: tuple[int, ...]


def quantize_model(weights: dict[str, torch.Tensor]) -> dict[str, Quantized]:
    """Store the course's pretrained decoder (lecture 9 section 2: 4 layers, d = 128) in few bits.

    ``weights`` maps each linear layer's weight name (``transformer.blocks.<i>.attention.query
    .weight``, ``...key``, ``...value``, ``...output``, ``...mlp.up``, ``...mlp.down``) to its
    float32 matrix: 786,432 weights; the word table, biases and LayerNorms stay as they are.
    Return a ``Quantized`` for every name. The grader rebuilds each matrix from it, runs the
    decoder on held-out text of the course's data and compares the perplexity with fp16's.

    Contract: perplexity at most 1% above fp16's. Graded on the bits per weight (all the stored
    bits of all the matrices / 786,432): full points at 4.0 or fewer, half at 4.25, a quarter at
    4.5. The library's NF4 with double-quantized scales (block 64) reaches about 4.13. Read
    QLoRA section 3 (NF4, double quantization), LLM.int8() section 3.2 (outliers), and measure:
    which layers can lose a bit, and what do block size and scale precision cost?
    """

    # TODO(task 4): which of the three costs -- codes, scales, codebooks -- dominates at your
    # block size? Does every matrix need the same number of bits? How would you find out,
    # using the course's data and the decoder (``minidist.models.pretrained``)?
    raise NotImplementedError("TODO(task 4): write quantize_model")
