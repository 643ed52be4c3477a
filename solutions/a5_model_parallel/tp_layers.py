"""Assignment 5, part 1: tensor parallelism, Megatron style (Shoeybi et al., 2019), for the MLP.

A transformer MLP is ``down(gelu(up(x)))`` with ``up: d -> ffn`` and ``down: ffn -> d``. Megatron
splits ``up`` by its OUTPUT features (column-parallel) and ``down`` by its INPUT features
(row-parallel), so that the GELU between them runs on each rank's slice alone::

            x (b, s, d), the same on every rank
            |
            f      forward: identity           backward: allreduce the gradient of x
      ______|______
     |             |
   up_0 (d, F/2)  up_1 (d, F/2)     ColumnParallelLinear: rank r holds rows r of the dense weight
     |             |
   gelu          gelu               elementwise: no communication
     |             |
  down_0 (F/2, d) down_1 (F/2, d)   RowParallelLinear: rank r holds columns r of the dense weight
     |_____________|
            |
            g      forward: allreduce (sum of the partial outputs)    backward: identity
            |
          + bias (once, after the sum)
            |
            y (b, s, d), the same on every rank

One allreduce forward (g), one backward (f): nothing else is sent. f and g are *conjugate*: each
is the other's transpose. Write them as ``torch.autograd.Function``s over ``md.allreduce``
(that is the primitive you may use; the library's tensor-parallel layers are off limits).

=====  ===================================  ==================================================
task   where                                what it does
=====  ===================================  ==================================================
1      ``CopyToTensorParallel``             f: identity forward, allreduce backward
2      ``ReduceFromTensorParallel``         g: allreduce forward, identity backward
3      ``ColumnParallelLinear``             rows of the weight; optional gather of the output
4      ``RowParallelLinear``                columns of the weight; the bias after the reduction
5      ``ParallelMLP``                      up (column), exact GELU, down (row)
=====  ===================================  ==================================================

Given: the other two conjugate pairs (``gather_from_tensor_parallel``: allgather forward, split
backward; ``scatter_to_tensor_parallel``: split forward, allgather backward) and ``shard_range``.

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


# --- tasks 1 and 2: the conjugate operators f and g ---------------------------------------
class CopyToTensorParallel(torch.autograd.Function):
    """f: the identity forward; backward, the SUM over ranks of the incoming gradients.

    Why: x feeds every rank's shard of the column-parallel layer, so dL/dx is the sum of what
    each shard sends back. Forward returns a new tensor equal to ``x`` (``x.clone()``, never
    ``x`` itself: autograd needs a new output); backward returns ``md.allreduce`` of a copy of
    the gradient (never modify the incoming gradient in place) and None for ``comm``.
    """

    @staticmethod
    def forward(ctx, x, comm):
        # TODO(task 1): keep comm on ctx; no communication here.
        ### BEGIN SOLUTION TODO(task 1): write CopyToTensorParallel.forward
        ctx.comm = comm
        return x.clone()
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # TODO(task 1): one md.allreduce (sum) of a copy of grad.
        ### BEGIN SOLUTION TODO(task 1): write CopyToTensorParallel.backward
        return md.allreduce(ctx.comm, grad.clone()), None
        ### END SOLUTION


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: forward, the SUM over ranks of ``x`` (one ``md.allreduce`` of a copy); backward, the identity.

    Why: each rank holds a partial sum of the row-parallel output; every rank needs the total.
    The gradient of a sum with respect to each of its terms is the gradient of the sum itself.
    """

    @staticmethod
    def forward(ctx, x, comm):
        # TODO(task 2): one md.allreduce of x.clone() (x itself must not change).
        ### BEGIN SOLUTION TODO(task 2): write ReduceFromTensorParallel.forward
        return md.allreduce(comm, x.clone())
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        # TODO(task 2): no communication here.
        ### BEGIN SOLUTION TODO(task 2): write ReduceFromTensorParallel.backward
        return grad, None
        ### END SOLUTION


def copy_to_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """f (identity forward, allreduce backward)."""
    return CopyToTensorParallel.apply(x, comm)


def reduce_from_tensor_parallel(x: torch.Tensor, comm) -> torch.Tensor:
    """g (allreduce forward, identity backward)."""
    return ReduceFromTensorParallel.apply(x, comm)


# --- task 3: column-parallel linear -----------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W (d_out, d_in) split by ROWS: rank r holds rows
    ``[r d_out/p, (r+1) d_out/p)`` of W (and the same entries of b), as ``self.weight``
    (d_out/p, d_in) and ``self.bias`` (d_out/p,) or None.

    forward(x): ``x`` is the full input (the same on every rank). Apply f to it (so that the
    backward sums dL/dx over ranks), then this rank's slice of the output, ``F.linear`` with its
    shard. ``gather_output=True``: return the full (..., d_out) output
    (``gather_from_tensor_parallel``); otherwise the (..., d_out/p) slice.

    Sizes: ``d_out`` must divide by ``comm.world_size`` (``shard_range`` raises the ValueError).
    The parameters start at zero; ``load_dense(weight, bias)`` copies this rank's shard of a
    dense layer's (d_out, d_in) weight and (d_out,) bias into them.
    """

    def __init__(self, d_in: int, d_out: int, comm, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.comm, self.d_in, self.d_out, self.gather_output = comm, d_in, d_out, gather_output
        # TODO(task 3): self.rows = shard_range(d_out, comm, "d_out"); zero Parameters of the
        # shard's shapes; self.bias = None without a bias.
        ### BEGIN SOLUTION TODO(task 3): write ColumnParallelLinear.__init__
        self.rows = shard_range(d_out, comm, "d_out")
        local = self.rows[1] - self.rows[0]
        self.weight = nn.Parameter(torch.zeros(local, d_in))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        ### END SOLUTION

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's rows of the dense ``weight`` (d_out, d_in) and entries of ``bias``."""
        # TODO(task 3): copy_ into self.weight (and self.bias when both exist).
        ### BEGIN SOLUTION TODO(task 3): write ColumnParallelLinear.load_dense
        start, stop = self.rows
        self.weight.copy_(weight[start:stop])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias[start:stop])
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(task 3): f, F.linear with the shard, gather if asked.
        ### BEGIN SOLUTION TODO(task 3): write ColumnParallelLinear.forward
        out = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)
        return gather_from_tensor_parallel(out, self.comm) if self.gather_output else out
        ### END SOLUTION


# --- task 4: row-parallel linear ----------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W (d_out, d_in) split by COLUMNS: rank r holds columns
    ``[r d_in/p, (r+1) d_in/p)`` of W as ``self.weight`` (d_out, d_in/p); the bias (d_out,) is
    whole on every rank (``self.bias``, or None).

    forward(x): ``input_is_parallel=True``: ``x`` is already this rank's (..., d_in/p) slice
    (what a column-parallel layer without gather gives); otherwise ``x`` is the full input and
    this rank takes its slice first (``scatter_to_tensor_parallel``). Then the partial product
    ``F.linear(x_r, W_r)`` (no bias!), g (the sum over ranks), and THEN the bias, once: adding
    it before g would add it p times.

    Sizes: ``d_in`` must divide by ``comm.world_size``. The parameters start at zero;
    ``load_dense(weight, bias)`` copies this rank's columns of the dense weight and the whole bias.
    """

    def __init__(
        self, d_in: int, d_out: int, comm, bias: bool = True, input_is_parallel: bool = True
    ) -> None:
        super().__init__()
        self.comm, self.d_in, self.d_out, self.input_is_parallel = comm, d_in, d_out, input_is_parallel
        # TODO(task 4): self.columns = shard_range(d_in, comm, "d_in"); zero Parameters.
        ### BEGIN SOLUTION TODO(task 4): write RowParallelLinear.__init__
        self.columns = shard_range(d_in, comm, "d_in")
        local = self.columns[1] - self.columns[0]
        self.weight = nn.Parameter(torch.zeros(d_out, local))
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None
        ### END SOLUTION

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's columns of the dense ``weight`` (d_out, d_in) and the whole ``bias``."""
        # TODO(task 4): copy_ into self.weight (and self.bias when both exist).
        ### BEGIN SOLUTION TODO(task 4): write RowParallelLinear.load_dense
        start, stop = self.columns
        self.weight.copy_(weight[:, start:stop])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(task 4): scatter unless input_is_parallel; partial product; g; the bias once.
        ### BEGIN SOLUTION TODO(task 4): write RowParallelLinear.forward
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.comm)
        out = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        return out + self.bias if self.bias is not None else out
        ### END SOLUTION


# --- task 5: the MLP -----------------------------------------------------------------------------
class ParallelMLP(nn.Module):
    """``down(gelu(up(x)))`` split Megatron's way (the picture at the top): ``self.up``, a
    ColumnParallelLinear(d, ffn) without gather; the exact GELU (``F.gelu``, no tanh
    approximation); ``self.down``, a RowParallelLinear(ffn, d) whose input is parallel.
    Exactly one allreduce forward and one backward per call.

    ``load_dense(mlp)`` takes a dense ``minidist.models.transformer.MLP`` (``mlp.up``,
    ``mlp.down``: ``nn.Linear``) and loads both layers' shards.
    """

    def __init__(self, d: int, ffn: int, comm) -> None:
        super().__init__()
        # TODO(task 5): self.up and self.down.
        ### BEGIN SOLUTION TODO(task 5): write ParallelMLP.__init__
        self.up = ColumnParallelLinear(d, ffn, comm, gather_output=False)
        self.down = RowParallelLinear(ffn, d, comm, input_is_parallel=True)
        ### END SOLUTION

    def load_dense(self, mlp: nn.Module) -> None:
        # TODO(task 5): load_dense of both layers.
        ### BEGIN SOLUTION TODO(task 5): write ParallelMLP.load_dense
        self.up.load_dense(mlp.up.weight, mlp.up.bias)
        self.down.load_dense(mlp.down.weight, mlp.down.bias)
        ### END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # TODO(task 5): three lines.
        ### BEGIN SOLUTION TODO(task 5): write ParallelMLP.forward
        return self.down(F.gelu(self.up(x)))
        ### END SOLUTION
