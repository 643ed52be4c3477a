"""8-bit integers: absmax int8, and LLM.int8()'s mixed decomposition for outlier features.

A weight stored in 8 bits is a code in [-127, 127] plus a floating-point *scale* shared by a
row (or a column): ``scale = absmax / 127``, code = round(w / scale). Two ideas, one after the
other:

1. **Absmax int8** (``quantize_absmax_int8``): one scale per row (or column). ``int8_matmul``
   multiplies int8 codes in int32 and rescales once per output element.
2. **LLM.int8()** (Dettmers et al. 2022, ``mixed_int8_matmul``): a few input features of a
   large transformer's hidden states carry outliers (|x| > 6) that would blow up the row scale
   and crush every other value to 0. Those columns are multiplied in 16-bit; the rest in int8.

The sibling ``nf4`` goes down to 4 bits (and reuses absmax int8 for its block scales);
``linear`` puts either format into a model.
"""

from __future__ import annotations

import torch

__all__ = [
    "dequantize_absmax_int8",
    "int8_matmul",
    "mixed_int8_matmul",
    "outlier_columns",
    "quantize_absmax_int8",
]

INT8_MAX = 127


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
