"""Variable-length messages on top of ``send``/``recv``.

A receiver must post a buffer of the right size, so a message whose length only the
sender knows (the rows a worker touched, a shard of sparse counts) travels as two:
first a one-element int64 tensor with the number of rows, then the rows themselves.
"""

from __future__ import annotations

import torch

from ..comm import Communicator


def send_rows(comm: Communicator, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
    """Send ``tensor`` (any first dimension, fixed trailing shape) to ``dst``."""
    comm.send(torch.tensor([tensor.shape[0]], dtype=torch.int64), dst, tag=tag)
    if tensor.shape[0]:
        comm.send(tensor.contiguous(), dst, tag=tag)


def recv_rows(
    comm: Communicator, src: int, dtype: torch.dtype, trailing: tuple[int, ...] = (), tag: int = 0
) -> torch.Tensor:
    """Receive what ``send_rows`` sent: a new tensor of shape (n, *trailing)."""
    length = torch.empty(1, dtype=torch.int64)
    comm.recv(length, src, tag=tag)
    out = torch.empty((int(length), *trailing), dtype=dtype)
    if out.shape[0]:
        comm.recv(out, src, tag=tag)
    return out
