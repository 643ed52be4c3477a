"""Bytes per format, by formula: how much memory each way of storing a weight takes.

A weight stored in fewer bits is a small integer code plus a floating-point *scale* shared by a
group of weights (the siblings ``int8`` and ``nf4``). Storing BLOOM-176B's weights takes
(``bytes_for``)::

    format  bits/param                     176B parameters
    fp32    32                             704 GB
    fp16    16                             352 GB
    int8     8   (+ 32 bits per row)       176 GB
    nf4      4   (+ 0.5 scale bits)         88 GB  (90.8 GB with double-quantized scales)
"""

from __future__ import annotations

from minidist.quant.nf4 import DOUBLE_QUANT_BLOCK

__all__ = ["FORMATS", "bits_per_param", "bytes_for"]

FORMATS = ("fp32", "fp16", "bf16", "int8", "int8-mixed", "nf4")


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
