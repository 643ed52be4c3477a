"""Tensor parallelism, Megatron style (Shoeybi et al., 2019): one layer's matrices split across ranks.

Every rank of ``comm`` holds 1/p of each big weight and computes 1/p of each big product; the
ranks see the *same* input batch. The trick is to split the two matrices of an MLP so that the
pair needs a single allreduce:

    Y = GeLU(X A)         A (d, f) split by COLUMNS:  A = [A_0 | A_1 | ... ]   (column-parallel)
                          rank r computes Y_r = GeLU(X A_r), its own f/p columns of Y.
                          GeLU acts element by element, so no communication is needed here:
                          GeLU([X A_0 | X A_1]) = [GeLU(X A_0) | GeLU(X A_1)].

    Z = Y B               B (f, d) split by ROWS:     B = [B_0 ; B_1 ; ... ]   (row-parallel)
                          rank r computes the partial sum Z_r = Y_r B_r (full shape (.., d)),
                          and Z = sum_r Z_r  -> ONE allreduce.

          X ──f──┬─► X A_0 ─ GeLU ─► Y_0 ─► Y_0 B_0 ─┐
                 └─► X A_1 ─ GeLU ─► Y_1 ─► Y_1 B_1 ─┴─g─► Z        (p = 2)

Had we split A by rows instead, X A would be a partial sum *before* the GeLU, and since
GeLU(a + b) != GeLU(a) + GeLU(b) we would need a second allreduce. Attention splits the same
way: Q, K, V column-parallel (each rank owns n_heads/p whole heads, and heads never talk to each
other), the output projection row-parallel.

Two conjugate operators carry the communication, written as autograd functions:

    f = copy_to_tensor_parallel       forward: identity     backward: allreduce (sum)
    g = reduce_from_tensor_parallel   forward: allreduce    backward: identity

f sits where a replicated X enters the split layers: every rank's X feeds only its own columns,
so dL/dX is the sum of the ranks' contributions. g sits where the partial sums leave: the sum's
gradient is the same on every rank, so it just passes through. Per transformer layer: forward
2 allreduces (g after attention, g after the MLP), backward 2 (f before attention, f before the
MLP). ``count_collectives(comm)`` counts them where they are issued.

The vocabulary is split too: ``VocabParallelEmbedding`` (each rank owns V/p rows of the table;
ids outside its range give zero, then g sums) and ``vocab_parallel_cross_entropy`` (the loss of
logits split along the vocabulary, computed with two small allreduces -- the row maximum and
[sum of exponentials, target logit] -- without ever gathering the (tokens, V) logits).

This module takes plain sizes and imports no model; ``minidist.models.tp_decoder`` builds a
decoder from these parts.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from minidist import collectives as _collectives

from ..comm import Communicator

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "check_divisible",
    "copy_to_tensor_parallel",
    "count_collectives",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "reset_collective_counts",
    "scatter_to_tensor_parallel",
    "vocab_parallel_cross_entropy",
]

IGNORE_INDEX = -100


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


# --- layers -------------------------------------------------------------------------------------
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
    once (adding it before g would count it p times).
    """

    def __init__(self, d_in, d_out, comm: Communicator, bias=True, input_is_parallel=True):
        super().__init__()
        self.comm, self.d_in, self.d_out = comm, d_in, d_out
        self.input_is_parallel = input_is_parallel
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
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"d_in={self.d_in} (local {self.weight.shape[1]}), d_out={self.d_out}, tp={self.comm.world_size}"
        )


class ParallelMLP(nn.Module):
    """Linear(d, ffn) ─ exact GELU ─ Linear(ffn, d): up column-parallel, down row-parallel.

    One f on the way in, one g on the way out: 1 allreduce forward, 1 backward.
    Parameters ``up.weight/bias``, ``down.weight/bias`` as in ``transformer.MLP``.
    """

    def __init__(self, d: int, ffn: int, comm: Communicator) -> None:
        super().__init__()
        check_divisible(ffn, "ffn (intermediate size)", comm)
        self.up = ColumnParallelLinear(d, ffn, comm)
        self.down = RowParallelLinear(ffn, d, comm)

    def load_dense(self, dense: nn.Module) -> None:
        """``dense`` has ``up`` and ``down`` Linears (``minidist.models.transformer.MLP``)."""
        self.up.load_dense(dense.up.weight, dense.up.bias)
        self.down.load_dense(dense.down.weight, dense.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split over the ranks: rank r owns heads
    [r H/p, (r+1) H/p).

        x ─f─► Q, K, V   column-parallel (this rank's heads: rows of W_q, W_k, W_v)
             ─► softmax(Q Kᵀ / √d_head + bias) V      per local head, no communication
             ─► output   row-parallel (this rank's columns of W_o) ─g─► (B, T, d)

    f is applied once for the three projections (so backward does one allreduce, not three).
    ``bias`` broadcasts to (B, H, T, T) as in ``transformer.MultiHeadSelfAttention``; a bias with
    a head dimension of H (ALiBi) is cut to this rank's heads.
    """

    def __init__(self, d: int, n_heads: int, comm: Communicator) -> None:
        super().__init__()
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
        self.output = RowParallelLinear(d, d, comm)

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
        x = copy_to_tensor_parallel(x, self.comm)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq_len, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H/p, T, T)
        bias = self.local_bias(bias)
        if bias is not None:
            scores = scores + bias
        out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq_len, -1)
        return self.output(out)


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: rank r holds ids [r V/p, (r+1) V/p).

    Each rank looks up the ids it owns and writes zeros for the others; g sums the ranks'
    results, so every position ends with exactly one non-zero contribution: 1 allreduce forward,
    none backward (each rank's rows get the gradient of the ids they own).
    """

    def __init__(self, vocab: int, d: int, comm: Communicator) -> None:
        super().__init__()
        self.comm, self.vocab, self.d = comm, vocab, d
        local = check_divisible(
            vocab, "vocab size", comm, hint="pad the vocabulary to a multiple of the degree"
        )
        self.start, self.end = comm.rank * local, (comm.rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, d, device=comm.device))
        nn.init.normal_(self.weight, std=0.02)

    def load_dense(self, weight: torch.Tensor) -> None:
        """Keep this rank's rows of the dense (vocab, d) table."""
        _copy_shard(self.weight, weight, 0, self.comm, "VocabParallelEmbedding.weight")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local_ids, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_from_tensor_parallel(x, self.comm)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split along the vocabulary; see ``vocab_parallel_cross_entropy``."""

    @staticmethod
    def forward(ctx, logits, labels, comm: Communicator, ignore_index):
        local_vocab = logits.shape[-1]
        ctx.dtype = logits.dtype
        start = comm.rank * local_vocab
        logits = logits.float()
        # 1. the row maximum over the whole vocabulary, for a stable softmax
        row_max = _allreduce(comm, logits.max(dim=-1).values, "forward", op="max")
        shifted = logits - row_max[:, None]
        exp = shifted.exp()
        # 2. one sum-allreduce of [Σ exp over my columns, my target logit or 0]
        owned = (labels >= start) & (labels < start + local_vocab)
        local_target = (labels - start).masked_fill(~owned, 0)
        target = shifted.gather(1, local_target[:, None])[:, 0].masked_fill(~owned, 0.0)
        summed = _allreduce(comm, torch.stack([exp.sum(dim=-1), target]), "forward")
        sum_exp, target = summed[0], summed[1]
        valid = labels != ignore_index
        count = valid.sum()
        losses = (sum_exp.log() - target).masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp, sum_exp, local_target, owned, valid)
        ctx.count = count
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        # d loss / d logit_j = (softmax_j - [j == target]) / count, for the columns this rank holds:
        # softmax_j needs only the global Σ exp already computed, so no communication.
        exp, sum_exp, local_target, owned, valid = ctx.saved_tensors
        grad_logits = exp / sum_exp[:, None]
        rows = torch.arange(grad_logits.shape[0], device=grad_logits.device)
        grad_logits[rows, local_target] -= owned.to(grad_logits.dtype)
        grad_logits *= (valid.to(grad_logits.dtype) * grad / ctx.count)[:, None]
        return grad_logits.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor, labels: torch.Tensor, comm: Communicator, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy over the labels that are not ``ignore_index``, from vocabulary-split logits.

    ``local_logits`` (..., V/p): rank r's columns [r V/p, (r+1) V/p) of the logits; ``labels``
    (...) global ids, the same on every rank. Equals
    ``F.cross_entropy(full_logits, labels, ignore_index=ignore_index)`` without building the
    full logits: per row, loss = log Σ_j exp(z_j - m) - (z_target - m), with
        m = max over all ranks                  (allreduce, op max)
        Σ exp and z_target                      (one sum-allreduce of both; only the owner of
                                                  the target id contributes a non-zero z_target)
    so 2 allreduces of (tokens,) numbers forward, 0 backward (the gradient is local).
    """
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits of shape {tuple(local_logits.shape)} and labels of shape {tuple(labels.shape)}: "
            "the labels must have the logits' shape without the last (vocabulary) dimension"
        )
    flat_logits = local_logits.reshape(-1, local_logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat_logits, labels.reshape(-1), comm, ignore_index)
