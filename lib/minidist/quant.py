"""Quantization from scratch: absmax int8, LLM.int8() mixed decomposition, 4-bit NormalFloat.

A weight stored in fewer bits is a small integer code plus a floating-point *scale* shared by a
group of weights. Storing BLOOM-176B's weights takes (``bytes_for``)::

    format  bits/param                     176B parameters
    fp32    32                             704 GB
    fp16    16                             352 GB
    int8     8   (+ 32 bits per row)       176 GB
    nf4      4   (+ 0.5 scale bits)         88 GB  (90.8 GB with double-quantized scales)

The three formats, each explained in its function's docstring:

1. **Absmax int8** (``quantize_absmax_int8``): one scale per row (or column),
   ``scale = absmax / 127``, code = round(w / scale) in [-127, 127]. ``int8_matmul`` multiplies
   int8 codes in int32 and rescales once per output element.
2. **LLM.int8()** (Dettmers et al. 2022, ``mixed_int8_matmul``): a few input features of a
   large transformer's hidden states carry outliers (|x| > 6) that would blow up the row scale
   and crush every other value to 0. Those columns are multiplied in 16-bit; the rest in int8.
3. **NF4** (Dettmers et al. 2023, QLoRA, ``quantize_nf4``): 16 code values at quantiles of the
   normal distribution (``nf4_code_values``), a scale per block of 64 weights, two codes per
   byte, and *double quantization* of the block scales (8-bit, block 256).

``QuantizedLinear`` / ``quantize_linear_weights(model, fmt)`` swap ``nn.Linear`` layers of any
model for ones that hold the quantized weight and dequantize (or int8-multiply) in forward.

Layer 4: imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "FORMATS",
    "NF4Tensor",
    "QuantizedLinear",
    "bits_per_param",
    "bytes_for",
    "dequantize_absmax_int8",
    "dequantize_nf4",
    "int8_matmul",
    "mixed_int8_matmul",
    "nf4_block_scales",
    "nf4_code_values",
    "outlier_columns",
    "pack_4bit",
    "quantize_absmax_int8",
    "quantize_linear_weights",
    "quantize_nf4",
    "unpack_4bit",
]

FORMATS = ("fp32", "fp16", "bf16", "int8", "int8-mixed", "nf4")

INT8_MAX = 127
DOUBLE_QUANT_BLOCK = 256


def _check_float(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"{name} must be a floating-point tensor, got {what}: quantize weights, not codes")


# --------------------------------------------------------------------------------------------
# 1. Absmax int8
# --------------------------------------------------------------------------------------------


def quantize_absmax_int8(t: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8: one scale per slice along ``dim`` (the dimension the max runs over).

    ``dim=-1`` on a matrix gives one scale per *row*, ``dim=0`` one per *column*::

        row = [0.5, -2.54, 1.0]     absmax = 2.54     scale = 2.54 / 127 = 0.02
        row / scale = [25, -127, 50]           (round to nearest, clamp to [-127, 127])
        dequantized = codes * scale = [0.5, -2.54, 1.0]     error <= scale / 2 per element

    Returns ``(codes int8, scales)``; ``scales`` keeps ``dim`` (size 1) so ``codes * scales``
    broadcasts. An all-zero slice gets scale 0 and codes 0 (no division by zero).
    -128 is never used: the range stays symmetric, so -x quantizes to -code(x).
    """
    _check_float(t, "t")
    absmax = t.abs().amax(dim=dim, keepdim=True).float()
    scale = absmax / INT8_MAX
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(t.float() / safe).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def dequantize_absmax_int8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``codes * scale`` in fp32 (the inverse of ``quantize_absmax_int8`` up to rounding)."""
    if codes.dtype != torch.int8:
        raise TypeError(f"codes must be int8, got {codes.dtype}")
    return codes.float() * scale


def _int_matmul_rescaled(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor
) -> torch.Tensor:
    """(xq @ wq) accumulated exactly in integers, then one multiply by sx_i * sw_j.

    ``xq`` (m, k) int8 with ``sx`` (m, 1); ``wq`` (k, n) int8 with ``sw`` (1, n).
    On CPU the product runs in int32 (|sum| <= 127 * 127 * k fits for k < 133,000). Elsewhere
    (CUDA has no general int32 matmul) it runs in float64, which holds those integers exactly.
    """
    if xq.device.type == "cpu":
        acc = xq.to(torch.int32) @ wq.to(torch.int32)
    else:
        acc = xq.to(torch.float64) @ wq.to(torch.float64)
    return acc.float() * sx * sw


def int8_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` with both operands in absmax int8: x per row, w per output column.

        x (..., k) ─quantize per row─► xq, sx (..., 1)
        w (k, n)   ─quantize per col─► wq, sw (1, n)
        y[i, j] = sx[i] * sw[j] * sum_k xq[i, k] * wq[k, j]        (the sum in int32)

    Row i of x and column j of w each have a single scale, so the scales factor out of the dot
    product. Since x = xq*sx + ex with |ex| <= sx/2 and w = wq*sw + ew with |ew| <= sw/2,
    the error of y[i, j] is at most ``sx_i/2 * sum_k |w_kj| + sw_j/2 * sum_k |xq_ik sx_i|``.
    """
    _check_float(x, "x")
    _check_float(w, "w")
    if w.dim() != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"int8_matmul needs x (..., k) and w (k, n); got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xq, sx = quantize_absmax_int8(x2, dim=-1)
    wq, sw = quantize_absmax_int8(w, dim=0)
    return _int_matmul_rescaled(xq, sx, wq, sw).reshape(*lead, w.shape[1]).to(x.dtype)


# --------------------------------------------------------------------------------------------
# 2. LLM.int8(): mixed-precision decomposition
# --------------------------------------------------------------------------------------------


def outlier_columns(x: torch.Tensor, threshold: float = 6.0) -> torch.Tensor:
    """Indices of input features (last dim of x) whose absmax over all rows exceeds ``threshold``."""
    _check_float(x, "x")
    return (x.reshape(-1, x.shape[-1]).abs().amax(dim=0) > threshold).nonzero().flatten()


def mixed_int8_matmul(
    x: torch.Tensor, w: torch.Tensor, threshold: float = 6.0, outlier_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """LLM.int8() (Dettmers et al. 2022): outlier feature columns in 16-bit, the rest in int8.

    In large transformers a handful of hidden dimensions hold values of magnitude 20-60 while
    the others stay near 1. With one scale per row of x, a single 60 makes the scale 60/127 ≈ 0.47
    and every ordinary value rounds to 0 or ±1 step. The decomposition splits the inner dimension::

        O = {k : max_i |x[i, k]| > threshold}            (a few columns of x, rows of w)
        x @ w = x[:, O] @ w[O, :]          in 16-bit      (outliers, exact-ish)
              + x[:, ~O] @ w[~O, :]        in int8        (the other 99.9 %, small row scales)

    ``outlier_dtype``: the precision of the outlier part; None keeps x's dtype (fp16/bf16 on a
    GPU, fp32 on a CPU where half matmuls are slow). Returns a tensor of x's dtype and shape
    (..., n).
    """
    _check_float(x, "x")
    _check_float(w, "w")
    if w.dim() != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"mixed_int8_matmul needs x (..., k) and w (k, n); got {tuple(x.shape)} and {tuple(w.shape)}"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    outliers = torch.zeros(x2.shape[1], dtype=torch.bool, device=x.device)
    outliers[outlier_columns(x2, threshold)] = True
    dtype = outlier_dtype or x.dtype
    y = (x2[:, outliers].to(dtype) @ w[outliers, :].to(dtype)).float()
    if not outliers.all():  # every feature an outlier (tiny k, low threshold): no int8 part left
        y = y + int8_matmul(x2[:, ~outliers], w[~outliers, :]).float()
    return y.reshape(*lead, w.shape[1]).to(x.dtype)


# --------------------------------------------------------------------------------------------
# 3. NF4: 4-bit NormalFloat with block-wise absmax and double quantization
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Memory per format
# --------------------------------------------------------------------------------------------


def bits_per_param(
    fmt: str,
    *,
    with_scales: bool = True,
    block: int = 64,
    double_quant: bool = True,
    row_length: int | None = None,
) -> float:
    """Bits per parameter of a format, by formula.

    fp32 32, fp16/bf16 16; int8 8 (+ 32/row_length for one fp32 scale per row, if given);
    nf4 4 (+ 32/block, or with double quantization 8/block + 32/(256*block)).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
    if fmt == "fp32":
        return 32.0
    if fmt in ("fp16", "bf16"):
        return 16.0
    if fmt in ("int8", "int8-mixed"):
        return 8.0 + (32.0 / row_length if with_scales and row_length else 0.0)
    scales = (8.0 / block + 32.0 / (DOUBLE_QUANT_BLOCK * block)) if double_quant else 32.0 / block
    return 4.0 + (scales if with_scales else 0.0)


def bytes_for(n_params: float, fmt: str, *, with_scales: bool = False, **kwargs) -> float:
    """Bytes to store ``n_params`` weights in ``fmt``: BLOOM-176B is 352 GB in fp16, 176 GB in
    int8, 88 GB in NF4 (90.8 GB counting double-quantized scales: ``with_scales=True``).
    ``kwargs`` go to ``bits_per_param`` (block, double_quant, row_length)."""
    return n_params * bits_per_param(fmt, with_scales=with_scales, **kwargs) / 8


# --------------------------------------------------------------------------------------------
# Quantized linear layers
# --------------------------------------------------------------------------------------------


def _int8_linear_forward(
    x2: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, threshold: float | None
) -> torch.Tensor:
    """y = x2 Wᵀ with W = codes * scale (per output row); x2 quantized per row in int8, except
    (``threshold`` not None) its outlier columns, which multiply the dequantized W columns."""
    y = torch.zeros(x2.shape[0], codes.shape[0], device=x2.device, dtype=torch.float32)
    regular = torch.ones(x2.shape[1], dtype=torch.bool, device=x2.device)
    if threshold is not None:
        regular[outlier_columns(x2, threshold)] = False
        w_outliers = dequantize_absmax_int8(codes[:, ~regular], scale)
        y += (x2[:, ~regular] @ w_outliers.to(x2.dtype).T).float()
    if regular.any():  # every feature an outlier (tiny k, low threshold): no int8 part left
        xq, sx = quantize_absmax_int8(x2[:, regular], dim=-1)
        y += _int_matmul_rescaled(xq, sx, codes[:, regular].T, scale.T)
    return y.to(x2.dtype)


class _Int8Linear(torch.autograd.Function):
    """Forward in int8; backward lets the gradient through to x as if x had not been rounded
    (straight-through): grad_x = grad_y · W, with W dequantized. The weight is frozen (no grad),
    which is what fine-tuning adapters on top of a quantized model (QLoRA, Petals) needs."""

    @staticmethod
    def forward(ctx, x2, codes, scale, threshold):  # noqa: ANN001, ANN205
        ctx.save_for_backward(codes, scale)
        return _int8_linear_forward(x2, codes, scale, threshold)

    @staticmethod
    def backward(ctx, grad_y):  # noqa: ANN001, ANN205
        codes, scale = ctx.saved_tensors
        w = dequantize_absmax_int8(codes, scale).to(grad_y.dtype)
        return grad_y @ w, None, None, None


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight (out, in) is stored in ``fmt``; y = x Wᵀ + b.

    fp32 / fp16 / bf16  the weight cast; forward casts it back to x's dtype
    int8                codes (out, in) + one scale per output row; forward quantizes x per row
                        and multiplies in int32 (``int8_matmul``'s scheme)
    int8-mixed          int8 storage as above; forward is LLM.int8(): input features of x above
                        ``threshold`` multiply the *dequantized* weight columns in x's dtype
    nf4                 ``quantize_nf4`` (block 64, double quantization); forward dequantizes
                        the whole weight to x's dtype and calls ``F.linear``

    Quantized tensors are buffers (they move with ``.to()``, appear in ``state_dict``); the bias
    stays in its dtype. ``weight_nbytes`` counts the stored weight tensors.
    """

    def __init__(self, linear: nn.Linear, fmt: str, threshold: float = 6.0, block: int = 64) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
        w = linear.weight.detach()
        self.fmt, self.threshold = fmt, threshold
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = (
            None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        )
        self._names: list[str] = []
        if fmt in ("fp32", "fp16", "bf16"):
            dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[fmt]
            self._store("weight_data", w.to(dtype).clone())
        elif fmt in ("int8", "int8-mixed"):
            codes, scale = quantize_absmax_int8(w, dim=1)  # one scale per output row
            self._store("weight_codes", codes)
            self._store("weight_scale", scale)
        else:
            q = quantize_nf4(w, block=block, double_quant=True)
            self._nf4_meta = (q.shape, q.block, q.dtype)
            for name, t in q.tensors().items():
                self._store(f"nf4_{name}", t)

    def _store(self, name: str, t: torch.Tensor) -> None:
        self.register_buffer(name, t)
        self._names.append(name)

    @property
    def weight_nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._names)

    def nf4(self) -> NF4Tensor:
        shape, block, dtype = self._nf4_meta
        return NF4Tensor(
            shape=shape, block=block, dtype=dtype, **{n[4:]: getattr(self, n) for n in self._names}
        )

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt in ("fp32", "fp16", "bf16"):
            return self.weight_data.to(dtype)
        if self.fmt == "nf4":
            return dequantize_nf4(self.nf4(), dtype)
        return dequantize_absmax_int8(self.weight_codes, self.weight_scale).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt in ("int8", "int8-mixed"):
            threshold = self.threshold if self.fmt == "int8-mixed" else None
            lead = x.shape[:-1]
            y = _Int8Linear.apply(
                x.reshape(-1, self.in_features), self.weight_codes, self.weight_scale, threshold
            )
            y = y.reshape(*lead, self.out_features)
            return y if self.bias is None else y + self.bias.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def quantize_linear_weights(model: nn.Module, fmt: str, skip: tuple[str, ...] = (), **kwargs) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a ``QuantizedLinear`` in ``fmt``.

    ``skip``: qualified names of Linear modules to leave alone (e.g. an output head).
    Weights that are not ``nn.Linear`` (embeddings, LayerNorms, a tied output matrix) are kept.
    Returns ``model``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; use one of {FORMATS}")
    if isinstance(model, nn.Linear):
        raise ValueError("model is itself an nn.Linear: build QuantizedLinear(model, fmt) instead")
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in skip]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantizedLinear(linear, fmt, **kwargs))
    return model
