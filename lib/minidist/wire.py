"""The wire header: the 20 integers in front of every message a transport sends.

Every message starts with a fixed header (kind, dtype, number of bytes, ndim, tag,
shape), so the receiver can check that the sender's tensor matches its buffer and raise
a clear ``MessageMismatch`` instead of silently reading garbage or waiting forever.
The transports (``transport.base.BaseComm``) write and check it; the shared-memory
allreduce reuses it for its own slots.
"""

from __future__ import annotations

import numpy as np
import torch

HEADER_INTS = 20  # int64 values per header
MAX_NDIM = HEADER_INTS - 5  # header: kind, dtype, nbytes, ndim, tag, shape...
KIND_DATA = 1
KIND_BARRIER = 2
_KIND_NAMES = {KIND_DATA: "a tensor", KIND_BARRIER: "a barrier message"}

# dtype <-> small integer code; the order is part of the wire format.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def encode_header(kind: int, tensor: torch.Tensor | None, tag: int = 0) -> np.ndarray:
    """Pack (kind, dtype, nbytes, ndim, tag, shape) into ``HEADER_INTS`` int64 values."""
    header = np.zeros(HEADER_INTS, dtype=np.int64)
    header[0] = kind
    header[4] = tag
    if tensor is not None:
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"minidist cannot send tensors of dtype {tensor.dtype}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(
                f"tensors with more than {MAX_NDIM} dimensions cannot be sent; "
                f"got {tensor.dim()}: reshape it first"
            )
        header[1] = _DTYPE_CODE[tensor.dtype]
        header[2] = tensor.numel() * tensor.element_size()
        header[3] = tensor.dim()
        header[5 : 5 + tensor.dim()] = tensor.shape
    return header


def describe_header(header: np.ndarray) -> str:
    kind = int(header[0])
    if kind != KIND_DATA:
        return _KIND_NAMES.get(kind, f"an unknown message (kind {kind})")
    dtype = DTYPES[int(header[1])]
    shape = tuple(int(s) for s in header[5 : 5 + int(header[3])])
    tag = f", tag {int(header[4])}" if header[4] else ""
    return f"a {str(dtype).removeprefix('torch.')} tensor of shape {shape} ({int(header[2])} bytes{tag})"


def describe_tensor(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"a {dtype} tensor of shape {tuple(t.shape)} ({t.numel() * t.element_size()} bytes)"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (works for bfloat16 and bool too)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)
