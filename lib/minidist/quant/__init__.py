"""Quantization from scratch: absmax int8, LLM.int8() mixed decomposition, 4-bit NormalFloat.

A weight stored in fewer bits is a small integer code plus a floating-point *scale* shared by a
group of weights: BLOOM-176B takes 352 GB in fp16, 176 GB in int8, 88 GB in NF4. One module a
format, each short enough to read in one sitting:

    int8      absmax int8 (``quantize_absmax_int8``, ``int8_matmul``) and LLM.int8()
              (Dettmers et al. 2022: ``outlier_columns``, ``mixed_int8_matmul``)
    nf4       4-bit NormalFloat (Dettmers et al. 2023, QLoRA: ``nf4_code_values``,
              ``quantize_nf4``, ``dequantize_nf4``, ``pack_4bit``), double-quantized scales
    formats   bytes per format by formula (``FORMATS``, ``bits_per_param``, ``bytes_for``)
    linear    ``QuantizedLinear`` / ``quantize_linear_weights(model, fmt)``: swap ``nn.Linear``
              layers of any model for ones that hold the quantized weight and dequantize (or
              int8-multiply) in forward

Foundations layer: imports torch only.
"""

from minidist.quant.formats import FORMATS, bits_per_param, bytes_for
from minidist.quant.int8 import (
    dequantize_absmax_int8,
    int8_matmul,
    mixed_int8_matmul,
    outlier_columns,
    quantize_absmax_int8,
)
from minidist.quant.linear import QuantizedLinear, quantize_linear_weights
from minidist.quant.nf4 import (
    NF4Tensor,
    dequantize_nf4,
    nf4_block_scales,
    nf4_code_values,
    pack_4bit,
    quantize_nf4,
    unpack_4bit,
)

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
