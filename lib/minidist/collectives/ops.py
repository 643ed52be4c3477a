"""Reduction operators and the small helpers every algorithm shares.

A reduction combines tensors element by element: ``sum``, ``max``, ``min``,
and ``avg`` (a sum divided by the world size at the very end; integer tensors
use floor division, as ``//`` does). All of them are associative and
commutative, which is what lets the algorithms combine partial results in any
grouping -- though for floating point, a different grouping can change the last
bits, so every algorithm here combines in a fixed order and all ranks end with
bit-identical results.
"""

from __future__ import annotations

import torch

OPS = ("sum", "avg", "max", "min")


def check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; choose one of {OPS}")
    if op == "sum" or op == "avg":  # (cheap string tests first: this runs on every allreduce)
        if tensor.dtype == torch.bool:
            raise TypeError(f"op={op!r} is not defined for bool tensors; use 'max' (or) or 'min' (and)")
    elif tensor.is_complex():
        raise TypeError(f"op={op!r} is not defined for complex tensors")


def combine_(acc: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    """acc = acc (op) other, in place. ``avg`` combines as a sum (see ``finish_``)."""
    if op in ("sum", "avg"):
        return acc.add_(other)
    if op == "max":
        return torch.maximum(acc, other, out=acc)
    return torch.minimum(acc, other, out=acc)


def finish_(tensor: torch.Tensor, op: str, world_size: int) -> torch.Tensor:
    """Turn a sum into an average once everything has been added up."""
    if op == "avg" and world_size > 1:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world_size)
        else:
            tensor.floor_divide_(world_size)
    return tensor


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous pieces whose sizes differ by at most 1.

    >>> chunk_bounds(10, 4)
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    >>> chunk_bounds(2, 4)      # fewer elements than parts: some pieces are empty
    [(0, 1), (1, 2), (2, 2), (2, 2)]
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class Flat:
    """A contiguous 1-D view of ``tensor`` to work on, written back by ``commit()``.

    Collectives work on flat vectors of elements; a non-contiguous tensor is
    copied into a contiguous buffer first, and the result copied back at the end.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.direct = tensor.is_contiguous()
        source = tensor.detach()
        self.flat = source.view(-1) if self.direct else source.contiguous().view(-1)

    def commit(self) -> torch.Tensor:
        if not self.direct:
            with torch.no_grad():
                self.tensor.copy_(self.flat.view(self.tensor.shape))
        return self.tensor
