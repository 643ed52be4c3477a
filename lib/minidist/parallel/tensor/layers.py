"""The split layers: a Linear cut by output rows (column-parallel) or by input columns (row-parallel).

``ColumnParallelLinear`` then ``RowParallelLinear`` is the Megatron pair (the picture in the
package docstring): the column-parallel layer needs no communication after it, the row-parallel
one a single g (allreduce) of its partial sums. ``ParallelMLP`` and ``ParallelSelfAttention``
are built from the pair. Each layer's ``load_dense`` keeps this rank's part of a dense layer,
so a test can compare it with one process. The communication is in ``operators``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import Communicator
from .operators import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
    scatter_to_tensor_parallel,
)
from .sequence import gather_and_linear, reduce_scatter_to_sequence_parallel, sum_grads_over_tensor_parallel

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "check_divisible",
]


def check_divisible(size: int, what: str, comm: Communicator, hint: str = "") -> int:
    """``size // comm.world_size``, or a ValueError naming both numbers."""
    p = comm.world_size
    if size % p:
        raise ValueError(
            f"{what} = {size} is not divisible by the tensor-parallel degree {p}: each rank holds "
            f"{what} / {p} of it; {hint or f'choose a {what} that is a multiple of {p} or another degree'}"
        )
    return size // p


def _copy_shard(param: nn.Parameter, dense: torch.Tensor, dim: int, comm: Communicator, name: str) -> None:
    part = param.shape[dim]
    expected = list(param.shape)
    expected[dim] = part * comm.world_size
    if list(dense.shape) != expected:
        raise ValueError(f"{name}: dense tensor has shape {tuple(dense.shape)}, expected {tuple(expected)}")
    with torch.no_grad():
        param.copy_(dense.narrow(dim, comm.rank * part, part))


class ColumnParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's output rows split: rank r holds rows [r d_out/p, (r+1) d_out/p).

    Input x replicated (passed through f, so its gradient is summed over the ranks);
    output y_r = x A_rᵀ + b_r, this rank's d_out/p features, or all d_out with
    ``gather_output=True`` (an allgather). ``copy_input=False`` leaves f out for a caller that
    applied it once already to an input shared by several layers (attention's Q, K, V).
    """

    def __init__(self, d_in, d_out, comm: Communicator, bias=True, gather_output=False, copy_input=True):
        super().__init__()
        self.comm, self.d_in, self.d_out = comm, d_in, d_out
        self.gather_output, self.copy_input = gather_output, copy_input
        local = check_divisible(d_out, "d_out", comm)
        self.weight = nn.Parameter(torch.empty(local, d_in, device=comm.device))
        self.bias = nn.Parameter(torch.zeros(local, device=comm.device)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's rows of the dense (d_out, d_in) weight and its part of the bias."""
        _copy_shard(self.weight, weight, 0, self.comm, "ColumnParallelLinear.weight")
        if self.bias is not None:
            if bias is None:
                raise ValueError("ColumnParallelLinear has a bias: pass the dense bias too")
            _copy_shard(self.bias, bias, 0, self.comm, "ColumnParallelLinear.bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_parallel(x, self.comm)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in}, d_out={self.d_out} (local {self.weight.shape[0]}), tp={self.comm.world_size}"
        )


class RowParallelLinear(nn.Module):
    """y = x Aᵀ + b with A's input columns split: rank r holds columns [r d_in/p, (r+1) d_in/p).

    Input: this rank's d_in/p features (``input_is_parallel=True``, e.g. the output of a
    ColumnParallelLinear), or the full x, of which the rank keeps its slice. Each rank computes
    the partial sum x_r A_rᵀ; g adds them up (one allreduce), then the replicated bias is added
    once (adding it before g would count it p times). ``sequence_parallel=True``: g-bar^T
    (a reduce-scatter along the sequence) in place of g; the output is this rank's S/p tokens,
    the bias is added to them only, so its gradient is summed over the ranks (an allreduce of
    d_out numbers in backward).
    """

    def __init__(
        self, d_in, d_out, comm: Communicator, bias=True, input_is_parallel=True, sequence_parallel=False
    ):
        super().__init__()
        self.comm, self.d_in, self.d_out = comm, d_in, d_out
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        local = check_divisible(d_in, "d_in", comm)
        self.weight = nn.Parameter(torch.empty(d_out, local, device=comm.device))
        self.bias = nn.Parameter(torch.zeros(d_out, device=comm.device)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Keep this rank's columns of the dense (d_out, d_in) weight; the bias is replicated."""
        _copy_shard(self.weight, weight, 1, self.comm, "RowParallelLinear.weight")
        if self.bias is not None:
            if bias is None:
                raise ValueError("RowParallelLinear has a bias: pass the dense bias too")
            with torch.no_grad():
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.comm)
        reduce = (
            reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        )
        y = reduce(F.linear(x, self.weight), self.comm)
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:  # seen by S/p tokens here: the gradient is a sum over the ranks
            (bias,) = sum_grads_over_tensor_parallel(self.comm, bias)
        return y + bias

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in} (local {self.weight.shape[1]}), d_out={self.d_out}, tp={self.comm.world_size}"
        )


class ParallelMLP(nn.Module):
    """Linear(d, ffn) ─ exact GELU ─ Linear(ffn, d): up column-parallel, down row-parallel.

    One f on the way in, one g on the way out: 1 allreduce forward, 1 backward.
    Parameters ``up.weight/bias``, ``down.weight/bias`` as in ``transformer.MLP``.
    ``sequence_parallel=True``: input and output are this rank's S/p tokens, g-bar (all-gather)
    in place of f and g-bar^T (reduce-scatter) in place of g (``sequence``; ``keep_gathered``
    is ``gather_and_linear``'s).
    """

    def __init__(
        self,
        d: int,
        ffn: int,
        comm: Communicator,
        sequence_parallel: bool = False,
        keep_gathered: bool = False,
    ) -> None:
        super().__init__()
        check_divisible(ffn, "ffn (intermediate size)", comm)
        self.comm, self.sequence_parallel, self.keep_gathered = comm, sequence_parallel, keep_gathered
        self.up = ColumnParallelLinear(d, ffn, comm)
        self.down = RowParallelLinear(ffn, d, comm, sequence_parallel=sequence_parallel)

    def load_dense(self, dense: nn.Module) -> None:
        """``dense`` has ``up`` and ``down`` Linears (``minidist.models.transformer.MLP``)."""
        self.up.load_dense(dense.up.weight, dense.up.bias)
        self.down.load_dense(dense.down.weight, dense.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            (up,) = gather_and_linear(x, [(self.up.weight, self.up.bias)], self.comm, self.keep_gathered)
        else:
            up = self.up(x)
        return self.down(F.gelu(up))


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split over the ranks: rank r owns heads
    [r H/p, (r+1) H/p).

        x ─f─► Q, K, V   column-parallel (this rank's heads: rows of W_q, W_k, W_v)
             ─► softmax(Q Kᵀ / √d_head + bias) V      per local head, no communication
             ─► output   row-parallel (this rank's columns of W_o) ─g─► (B, T, d)

    f is applied once for the three projections (so backward does one allreduce, not three).
    ``bias`` broadcasts to (B, H, T, T) as in ``transformer.MultiHeadSelfAttention``; a bias with
    a head dimension of H (ALiBi) is cut to this rank's heads. ``sequence_parallel=True``: x and
    the output are this rank's S/p tokens; one g-bar (all-gather) for Q, K, V in place of f, and
    g-bar^T (reduce-scatter) in place of g (``sequence``).
    """

    def __init__(
        self,
        d: int,
        n_heads: int,
        comm: Communicator,
        sequence_parallel: bool = False,
        keep_gathered: bool = False,
    ) -> None:
        super().__init__()
        self.sequence_parallel, self.keep_gathered = sequence_parallel, keep_gathered
        if d % n_heads:
            raise ValueError(f"hidden size {d} is not divisible by n_heads {n_heads}")
        self.comm, self.n_heads, self.head_dim = comm, n_heads, d // n_heads
        self.local_heads = check_divisible(
            n_heads,
            "n_heads",
            comm,
            hint="each rank owns whole heads: choose n_heads a multiple of the degree",
        )
        self.query = ColumnParallelLinear(d, d, comm, copy_input=False)
        self.key = ColumnParallelLinear(d, d, comm, copy_input=False)
        self.value = ColumnParallelLinear(d, d, comm, copy_input=False)
        self.output = RowParallelLinear(d, d, comm, sequence_parallel=sequence_parallel)

    def load_dense(self, dense: nn.Module) -> None:
        """``dense`` has ``query``, ``key``, ``value``, ``output`` Linears (``MultiHeadSelfAttention``)."""
        for name in ("query", "key", "value", "output"):
            layer = getattr(dense, name)
            getattr(self, name).load_dense(layer.weight, layer.bias)

    def local_bias(self, bias: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's heads of an attention bias (a head dimension of 1 broadcasts as it is)."""
        if bias is None or bias.dim() < 3 or bias.shape[-3] == 1:
            return bias
        if bias.shape[-3] != self.n_heads:
            raise ValueError(
                f"attention bias has {bias.shape[-3]} heads in dimension -3, the layer {self.n_heads}: "
                "pass a bias broadcastable to (batch, n_heads, T, T)"
            )
        start = self.comm.rank * self.local_heads
        return bias.narrow(-3, start, self.local_heads)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq_len, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq_len, self.local_heads, self.head_dim).transpose(1, 2)

        if self.sequence_parallel:
            seq_len *= self.comm.world_size
            pairs = [(layer.weight, layer.bias) for layer in (self.query, self.key, self.value)]
            q, k, v = map(heads, gather_and_linear(x, pairs, self.comm, self.keep_gathered))
        else:
            x = copy_to_tensor_parallel(x, self.comm)
            q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H/p, T, T)
        bias = self.local_bias(bias)
        if bias is not None:
            scores = scores + bias
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq_len, -1)
        return self.output(out)
