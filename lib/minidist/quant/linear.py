"""Quantized linear layers: swap a model's ``nn.Linear`` for one that holds its weight in few bits.

``QuantizedLinear`` stores the weight in any of ``formats.FORMATS`` (``int8`` codes with a
scale per output row, or ``nf4`` blocks) as buffers, and in forward either multiplies in int8
(the sibling ``int8``'s scheme, LLM.int8() for ``int8-mixed``) or dequantizes (``nf4``) and
calls ``F.linear``. The weight is frozen, but gradients flow to the input (straight-through),
which is what training adapters on a quantized base (QLoRA, ``models.lora``) needs.
``quantize_linear_weights(model, fmt)`` does the swap for every linear layer of a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.quant.formats import FORMATS
from minidist.quant.int8 import (
    _int_matmul_rescaled,
    dequantize_absmax_int8,
    outlier_columns,
    quantize_absmax_int8,
)
from minidist.quant.nf4 import NF4Tensor, dequantize_nf4, quantize_nf4

__all__ = ["QuantizedLinear", "quantize_linear_weights"]


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
