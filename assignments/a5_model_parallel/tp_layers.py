"""Assignment 5, part 1: tensor parallelism, Megatron style (Shoeybi et al., 2019), for the MLP.

A transformer MLP is ``down(gelu(up(x)))`` with ``up: d -> ffn`` and ``down: ffn -> d``. On p
ranks, each rank holds 1/p of each weight, the output equals the dense MLP's on every rank, and
the whole MLP costs exactly one allreduce of one activation (batch x seq x d) in the forward and
one in the backward -- nothing else is sent. How the two weights must be cut for the GELU to run
on each rank's slice alone, and where the two allreduces go, is the design: read lecture 7,
section 3 (tensor parallelism, the conjugate operators f and g) and Shoeybi et al. 2019,
"Megatron-LM", section 3 and figure 3.

=====  ===================================  ==================================================
task   where                                what it does
=====  ===================================  ==================================================
1      ``CopyToTensorParallel`` (f),        the operator that enters the tensor-parallel
       ``ColumnParallelLinear``             region, and the layer cut by output features
2      ``ReduceFromTensorParallel`` (g),    the operator that leaves it, and the layer cut by
       ``RowParallelLinear``                input features
3      ``ParallelMLP``                      the MLP on p ranks, one allreduce each way
=====  ===================================  ==================================================

Given: the other two conjugate pairs (``gather_from_tensor_parallel``: allgather forward, split
backward; ``scatter_to_tensor_parallel``: split forward, allgather backward) and ``shard_range``.
``md.allreduce`` and ``md.allgather`` are the primitives you use; the library's tensor-parallel
layers are off limits.

Run the public tests from this folder (``grep -n "TODO(task" tp_layers.py schedule.py``: what
is left)::

    python -m pytest -q test_a5_model_parallel.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: F401  (your layers call F.linear and F.gelu)

import minidist as md

__all__ = [
    "ColumnParallelLinear",
    "CopyToTensorParallel",
    "ParallelMLP",
    "ReduceFromTensorParallel",
    "RowParallelLinear",
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "shard_range",
]


# --- given: sizes, and the gather/scatter pair -------------------------------------------
def shard_range(size: int, comm, what: str = "size") -> tuple[int, int]:
    """``(start, stop)`` of rank ``comm.rank``'s equal share of ``size``; ValueError if it does not divide."""
    p = comm.world_size
    if size % p != 0:
        raise ValueError(
            f"{what} = {size} does not divide by the tensor-parallel degree {p}: "
            f"choose a {what} that is a multiple of {p}"
        )
    share = size // p
    return comm.rank * share, (comm.rank + 1) * share


class _GatherLastDim(torch.autograd.Function):
    """Forward: concatenate every rank's last-dim slice (allgather); backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm, ctx.width = comm, x.shape[-1]
        rows = md.allgather(comm, x.contiguous())  # (world_size, *x.shape)
        return torch.cat(list(rows.unbind(0)), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.comm.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


class _ScatterLastDim(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim; backward: allgather the slices' gradients."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        start, stop = shard_range(x.shape[-1], comm, "the last dimension")
        return x[..., start:stop].contiguous()

    @staticmethod
    def backward(ctx, grad):
        rows = md.allgather(ctx.comm, grad.contiguous())
        return torch.cat(list(rows.unbind(0)), dim=-1), None


def gather_from_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """Allgather on the last dimension forward, split backward (one allgather, forward only)."""
    return _GatherLastDim.apply(x, comm)


def scatter_to_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """Split on the last dimension forward, allgather backward (one allgather, backward only)."""
    return _ScatterLastDim.apply(x, comm)


# --- the conjugate operators f (task 1) and g (task 2) ----------------------------------------
class CopyToTensorParallel(torch.autograd.Function):
    """f, an autograd Function of ``(x, comm)``: the operator in front of a column-parallel layer.

    Contract: the forward returns a new tensor equal to ``x`` and communicates nothing; the
    backward returns the gradient of x for the whole model (and None for ``comm``), with exactly
    one ``md.allreduce``. Neither changes its input or the incoming gradient in place.

    Questions: x reaches every rank's shard; what is dL/dx, then, and who holds its pieces?
    Why must the forward not return ``x`` itself?
    """

    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("TODO(task 1): write CopyToTensorParallel.forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO(task 1): write CopyToTensorParallel.backward")


class ReduceFromTensorParallel(torch.autograd.Function):
    """g, an autograd Function of ``(x, comm)``: the operator behind a row-parallel layer, f's
    conjugate (each is the other's transpose).

    Contract: the forward returns the sum over ranks of ``x`` with exactly one ``md.allreduce``
    (``x`` itself unchanged); the backward communicates nothing.

    Questions: what is the gradient of a sum with respect to one of its terms? Which rank
    already has it?
    """

    @staticmethod
    def forward(ctx, x, comm):
        raise NotImplementedError("TODO(task 2): write ReduceFromTensorParallel.forward")

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("TODO(task 2): write ReduceFromTensorParallel.backward")


def copy_to_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """f (identity forward, allreduce backward)."""
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """g (allreduce forward, identity backward)."""
    return ReduceFromTensorParallel.apply(x, comm)


# --- task 1: column-parallel linear (with f) ----------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` for a dense W (d_out, d_in), cut by output features: rank r holds rows
    ``[r d_out/p, (r+1) d_out/p)`` of W and the same entries of b, as ``self.weight``
    (d_out/p, d_in) and ``self.bias`` (d_out/p,) or None (``bias=False``).

    Contract: ``x`` (..., d_in) is the same on every rank. The output is this rank's slice
    (..., d_out/p) of the dense layer's, or with ``gather_output=True`` the whole (..., d_out);
    the gradient of ``x`` is the dense layer's, and each shard's gradient is its slice of the
    dense one. ``d_out`` must divide by p (``shard_range`` raises the ValueError). The parameters
    start at zero; ``load_dense(weight, bias)`` copies this rank's shard of a dense layer's into
    them, and the layer computes with ``self.weight`` and ``self.bias`` (the grader changes them
    after loading).

    Cost: no communication in the forward without the gather (one allgather with it); one
    allreduce of x's size in the backward.
    """

    def __init__(self, d_in: int, d_out: int, comm, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.comm, self.d_in, self.d_out, self.gather_output = comm, d_in, d_out, gather_output
        # TODO(task 1): self.rows, this rank's rows (``shard_range``); the zero parameters.
        raise NotImplementedError("TODO(task 1): write ColumnParallelLinear.__init__")

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of the dense ``weight`` (d_out, d_in) and entries of ``bias``."""
        raise NotImplementedError("TODO(task 1): write ColumnParallelLinear.load_dense")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO(task 1): write ColumnParallelLinear.forward")


# --- task 2: row-parallel linear (with g) -------------------------------------------------------
class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` for a dense W (d_out, d_in), cut by input features: rank r holds columns
    ``[r d_in/p, (r+1) d_in/p)`` of W as ``self.weight`` (d_out, d_in/p); the bias (d_out,) is
    whole on every rank (``self.bias``, or None).

    Contract: with ``input_is_parallel=True``, ``x`` is this rank's (..., d_in/p) slice of the
    input (what a column-parallel layer without gather gives); otherwise the whole (..., d_in)
    input. The output (..., d_out) is the dense layer's, on every rank; the gradients of ``x`` and
    of each shard are their parts of the dense ones. ``d_in`` must divide by p. ``load_dense``
    copies this rank's columns of the dense weight and the whole bias; the layer computes with
    ``self.weight`` and ``self.bias``.

    Cost: one allreduce of the output's size in the forward; none in the backward with a
    parallel input (one allgather without).

    Questions: what does each rank hold after its partial product, and what do the ranks need?
    Where may the bias go, and how many times is it added if it goes anywhere else?
    """

    def __init__(
        self, d_in: int, d_out: int, comm, bias: bool = True, input_is_parallel: bool = True
    ) -> None:
        super().__init__()
        self.comm, self.d_in, self.d_out, self.input_is_parallel = comm, d_in, d_out, input_is_parallel
        # TODO(task 2): self.columns, this rank's columns (``shard_range``); the zero parameters.
        raise NotImplementedError("TODO(task 2): write RowParallelLinear.__init__")

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of the dense ``weight`` (d_out, d_in) and the whole ``bias``."""
        raise NotImplementedError("TODO(task 2): write RowParallelLinear.load_dense")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO(task 2): write RowParallelLinear.forward")


# --- task 3: the MLP -----------------------------------------------------------------------------
class ParallelMLP(nn.Module):
    """The dense ``minidist.models.transformer.MLP`` (``down(gelu(up(x)))``, exact GELU) on p
    ranks, as ``self.up`` and ``self.down`` built from your layers.

    Contract: ``x`` (batch, seq, d) and the output are the same on every rank and equal the dense
    MLP's, and so are the gradients (each shard's, its part); ``ffn`` divides by p.
    ``load_dense(mlp)`` takes the dense MLP (``mlp.up``, ``mlp.down``: ``nn.Linear``) and loads
    both layers' shards.

    Cost: exactly one allreduce of one activation in the forward and one in the backward per
    call, counted by the grader; nothing else.

    Questions: which cut of ``up`` lets the GELU run on each rank's slice alone, and which cut of
    ``down`` takes that slice as it is? Where, then, are the two allreduces?
    """

    def __init__(self, d: int, ffn: int, comm) -> None:
        super().__init__()
        raise NotImplementedError("TODO(task 3): write ParallelMLP.__init__")

    def load_dense(self, mlp: nn.Module) -> None:
        raise NotImplementedError("TODO(task 3): write ParallelMLP.load_dense")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TODO(task 3): write ParallelMLP.forward")
