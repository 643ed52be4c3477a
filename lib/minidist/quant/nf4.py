"""4-bit NormalFloat (NF4, Dettmers et al. 2023, QLoRA): 16 code values where normal weights sit.

Pretrained weights are roughly normal, so NF4 puts its 16 code values at quantiles of the normal
distribution (``nf4_code_values``), scales each block of 64 weights by its absmax, packs two
codes per byte (``pack_4bit``), and stores the block scales themselves in 8 bits (*double
quantization*, blocks of 256, with the sibling ``int8``'s absmax):

    w ──► blocks of 64 ──► / absmax ──► nearest NF4 value (4 bits) ──► two codes a byte
                              │
                              └──► absmax - mean ──► int8, one fp32 scale per 256 blocks

4 + 8/64 + 32/(64·256) = 4.127 bits a parameter (``quantize_nf4``'s docstring does the sums);
``dequantize_nf4`` reverses it, and ``linear.QuantizedLinear`` stores a layer this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minidist.quant.int8 import _check_float, dequantize_absmax_int8, quantize_absmax_int8

__all__ = [
    "NF4Tensor",
    "dequantize_nf4",
    "nf4_block_scales",
    "nf4_code_values",
    "pack_4bit",
    "quantize_nf4",
    "unpack_4bit",
]

DOUBLE_QUANT_BLOCK = 256


def nf4_code_values() -> torch.Tensor:
    """The 16 NF4 values, derived from quantiles of N(0, 1) as QLoRA (Dettmers et al. 2023) does.

    Idea: pretrained weights are roughly normal, so put the code values where equal slices of
    probability mass sit -- quantiles -- then scale them into [-1, 1]. A symmetric 4-bit set of
    quantiles would have no exact 0 (16 values, 8 each side), and 0 matters (padding, pruned and
    zero-initialised weights). NF4 is therefore *asymmetric*: 8 positive values, 7 negative, and 0:

        positive  p_j = 1/2 + j/8 * (δ - 1/2),  j = 1..8   v = Φ⁻¹(p_j) / Φ⁻¹(δ)   (8 values, last = 1)
        negative  p_j = 1/2 + j/7 * (δ - 1/2),  j = 1..7   v = -Φ⁻¹(p_j) / Φ⁻¹(δ)  (7 values, last = -1)
        zero      0

    The quantile function Φ⁻¹ is infinite at probability 1, so the outermost quantile is taken
    at δ = 1 - (1/32 + 1/30)/2 ≈ 0.9677 (the middle of where the two halves' last bins sit for
    16 and 15 bins). Values, ascending:

        -1, -0.696, -0.525, -0.395, -0.284, -0.185, -0.091, 0,
         0.080, 0.161, 0.246, 0.338, 0.441, 0.563, 0.723, 1

    Index 7 is 0, index 15 is 1, index 0 is -1.
    """
    delta = 1.0 - 0.5 * (1.0 / 32 + 1.0 / 30)
    top = torch.special.ndtri(torch.tensor(delta, dtype=torch.float64))
    pos = torch.special.ndtri(0.5 + torch.arange(1, 9, dtype=torch.float64) / 8 * (delta - 0.5)) / top
    neg = -torch.special.ndtri(0.5 + torch.arange(1, 8, dtype=torch.float64) / 7 * (delta - 0.5)) / top
    values = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos])
    return values.sort().values.float()


def pack_4bit(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte, the *first* code of each pair in the high nibble.

    codes [3, 12, 7, 0]  ->  bytes [0x3C, 0x70]  (= [60, 112])
    """
    if codes.numel() % 2:
        raise ValueError(f"pack_4bit needs an even number of codes, got {codes.numel()}: pad with one more")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("pack_4bit codes must lie in [0, 15]")
    c = codes.reshape(-1).to(torch.uint8)
    return (c[0::2] << 4) | c[1::2]


def unpack_4bit(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_4bit``: a byte b gives codes (b >> 4, b & 15), in that order."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1)


@dataclass
class NF4Tensor:
    """A tensor stored in NF4: what ``quantize_nf4`` returns and ``dequantize_nf4`` reads.

    packed         uint8 (numel_padded / 2,)    two codes per byte (``pack_4bit``)
    absmax         fp32 (n_blocks,)             block scales, without double quantization
    absmax_codes   int8 (n_blocks_padded,)      with double quantization: (absmax - mean) in int8 ...
    absmax_scale   fp32 (n_blocks_padded/256,)  ... with one fp32 scale per 256 block scales
    absmax_mean    fp32 ()                      ... and the mean that was subtracted first
    shape, block, dtype                         the original tensor's shape, block size and dtype
    """

    packed: torch.Tensor
    shape: torch.Size
    block: int
    dtype: torch.dtype
    absmax: torch.Tensor | None = None
    absmax_codes: torch.Tensor | None = None
    absmax_scale: torch.Tensor | None = None
    absmax_mean: torch.Tensor | None = None

    @property
    def double_quant(self) -> bool:
        return self.absmax_codes is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every stored tensor by name (what ``nbytes`` adds up and ``QuantizedLinear`` registers)."""
        names = ("packed", "absmax", "absmax_codes", "absmax_scale", "absmax_mean")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes held by the stored tensors (codes and every level of scales)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def bits_per_param(self) -> float:
        return 8 * self.nbytes / self.numel()


def _pad_to(flat: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    extra = (-flat.numel()) % multiple
    return F.pad(flat, (0, extra), value=value) if extra else flat


def quantize_nf4(w: torch.Tensor, block: int = 64, double_quant: bool = True) -> NF4Tensor:
    """Block-wise NF4 (QLoRA). Flatten, cut into blocks of ``block`` values, per block::

        absmax = max |w|                       block [0.2, -0.8, 0.4, 0.05]  absmax 0.8
        n = w / absmax  in [-1, 1]             n = [0.25, -1, 0.5, 0.0625]
        code = index of the nearest NF4 value  [10, 0, 12, 8]  (0.246, -1, 0.441, 0.080)
        dequantized = NF4[code] * absmax       [0.197, -0.8, 0.353, 0.064]

    The error of each value is at most half the gap between its two neighbouring code values
    times the block absmax (largest gap: 0.723 → 1, so |err| <= 0.139 * absmax).

    Storage: 4 bits per value plus one fp32 absmax per block = 4 + 32/64 = 4.5 bits per param.
    *Double quantization* (``double_quant=True``) quantizes those block scales again: subtract
    their mean (they are all positive, so centring uses the symmetric int8 range fully), then
    absmax int8 in blocks of 256 with one fp32 scale each: 8/64 + 32/(64*256) = 0.127 bits per
    param instead of 0.5, so 4.127 bits in all (QLoRA reports ~0.373 bits saved per param).

    A tensor whose size is not a multiple of ``block`` is **padded with zeros** to whole blocks
    (the padding's codes are stored and counted in ``nbytes``); ``dequantize_nf4`` drops them.
    ``block`` must be even (two codes per byte).
    """
    _check_float(w, "w")
    if block <= 0 or block % 2:
        raise ValueError(f"block must be a positive even number (two 4-bit codes per byte), got {block}")
    if w.numel() == 0:
        raise ValueError("cannot quantize an empty tensor")
    blocks = _pad_to(w.detach().reshape(-1).float(), block).reshape(-1, block)
    absmax = blocks.abs().amax(dim=1)
    safe = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    normed = blocks / safe[:, None]
    code_values = nf4_code_values().to(w.device)
    midpoints = (code_values[1:] + code_values[:-1]) / 2
    codes = torch.bucketize(normed, midpoints)  # nearest code value (values between midpoints)
    q = NF4Tensor(packed=pack_4bit(codes), shape=w.shape, block=block, dtype=w.dtype)
    if not double_quant:
        q.absmax = absmax
        return q
    mean = absmax.mean()
    centred = _pad_to(absmax - mean, DOUBLE_QUANT_BLOCK).reshape(-1, DOUBLE_QUANT_BLOCK)
    scale_codes, scale_scales = quantize_absmax_int8(centred, dim=1)
    q.absmax_codes = scale_codes.reshape(-1)
    q.absmax_scale = scale_scales.reshape(-1)
    q.absmax_mean = mean
    return q


def nf4_block_scales(q: NF4Tensor) -> torch.Tensor:
    """The fp32 absmax of each block (dequantized first when double-quantized)."""
    n_blocks = -(-q.numel() // q.block)
    if not q.double_quant:
        return q.absmax
    codes = q.absmax_codes.reshape(-1, DOUBLE_QUANT_BLOCK)
    return (dequantize_absmax_int8(codes, q.absmax_scale[:, None]).reshape(-1) + q.absmax_mean)[:n_blocks]


def dequantize_nf4(q: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """NF4 codes -> values: ``NF4[code] * absmax[block]``, padding dropped, reshaped, cast to
    ``dtype`` (default: the dtype the tensor had)."""
    code_values = nf4_code_values().to(q.packed.device)
    codes = unpack_4bit(q.packed).long().reshape(-1, q.block)
    values = code_values[codes] * nf4_block_scales(q)[:, None]
    return values.reshape(-1)[: q.numel()].reshape(q.shape).to(dtype or q.dtype)
