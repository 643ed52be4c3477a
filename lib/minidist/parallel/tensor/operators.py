"""The communication of tensor parallelism: every collective the split layers issue, counted.

Two conjugate operators carry the communication, written as autograd functions:

    f = copy_to_tensor_parallel       forward: identity     backward: allreduce (sum)
    g = reduce_from_tensor_parallel   forward: allreduce    backward: identity

f sits where a replicated X enters the split layers: every rank's X feeds only its own columns,
so dL/dX is the sum of the ranks' contributions. g sits where the partial sums leave: the sum's
gradient is the same on every rank, so it just passes through. Per transformer layer: forward
2 allreduces (g after attention, g after the MLP), backward 2 (f before attention, f before the
MLP). ``count_collectives(comm)`` counts them where they are issued.

A second pair moves a tensor between "split along the last dimension" and "whole": gather
(allgather forward, keep my slice backward) and scatter (keep my slice forward, allgather
backward). The layers (``layers``, ``vocab``) call only these four functions, so every
collective of tensor parallelism is issued, and counted, in this file -- except sequence
parallelism's all-gathers and reduce-scatters (g-bar, g-bar^T), issued and counted in ``sequence``.
"""

from __future__ import annotations

import weakref

import torch

from minidist import collectives as _collectives

from ...comm import Communicator

__all__ = [
    "copy_to_tensor_parallel",
    "count_collectives",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "reset_collective_counts",
    "scatter_to_tensor_parallel",
]


# --- counting -----------------------------------------------------------------------------------
_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _zero_counts() -> dict:
    return {"forward": {"allreduce": 0, "allgather": 0}, "backward": {"allreduce": 0, "allgather": 0}}


def _counts_of(comm: Communicator) -> dict:
    counts = _COUNTS.get(comm)
    if counts is None:
        counts = _COUNTS[comm] = _zero_counts()
    return counts


def count_collectives(comm: Communicator) -> dict:
    """Collectives the layers of this module issued on ``comm`` since the last reset.

    ``{"forward": {"allreduce": n, "allgather": n}, "backward": {"allreduce": n, "allgather": n}}``
    (a copy). Counted at the call sites: "forward" for calls made in a forward pass, "backward"
    for calls made by an autograd backward.
    """
    counts = _counts_of(comm)
    return {phase: dict(ops) for phase, ops in counts.items()}


def reset_collective_counts(comm: Communicator) -> None:
    """Set the counts of ``comm`` back to zero."""
    _COUNTS[comm] = _zero_counts()


def _allreduce(comm: Communicator, tensor: torch.Tensor, phase: str, op: str = "sum") -> torch.Tensor:
    """Sum (or max) ``tensor`` over the ranks into a new tensor, counting the call."""
    out = tensor.clone()
    if comm.world_size > 1:
        _counts_of(comm)[phase]["allreduce"] += 1
        _collectives.allreduce(comm, out, op=op)
    return out


def _gather_last_dim(comm: Communicator, tensor: torch.Tensor, phase: str) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dimension, counting the call."""
    if comm.world_size == 1:
        return tensor
    _counts_of(comm)[phase]["allgather"] += 1
    gathered = _collectives.allgather(comm, tensor.contiguous())  # (p, ..., n)
    return torch.cat(list(gathered.unbind(0)), dim=-1)


def _my_slice_last_dim(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    size = tensor.shape[-1]
    if size % comm.world_size:
        raise ValueError(
            f"last dimension {size} is not divisible by the tensor-parallel degree {comm.world_size}"
        )
    part = size // comm.world_size
    return tensor[..., comm.rank * part : (comm.rank + 1) * part].contiguous()


# --- the conjugate operators ------------------------------------------------------------------
class _CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward, allreduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce(ctx.comm, grad, "backward"), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: allreduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        return _allreduce(comm, x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Allgather along the last dimension forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return _gather_last_dim(comm, x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last_dim(ctx.comm, grad), None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; backward allgathers the gradient."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return _my_slice_last_dim(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(ctx.comm, grad, "backward"), None


def copy_to_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """f: identity forward, allreduce backward (where a replicated input enters split layers)."""
    return _CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """g: allreduce forward, identity backward (where the ranks' partial sums are added up)."""
    return _ReduceFromTensorParallel.apply(x, comm)


def gather_from_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Allgather on the last dimension forward (rank order), split backward."""
    return _GatherFromTensorParallel.apply(x, comm)


def scatter_to_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's 1/p of the last dimension forward, allgather backward."""
    return _ScatterToTensorParallel.apply(x, comm)
