"""Sequence parallelism (Korthikanti et al., 2022): what tensor parallelism leaves whole, split by tokens.

Tensor parallelism splits the matrices, but between two split regions every rank holds the
WHOLE (B, S, h) activation: the LayerNorms, the residual adds (and dropout, where there is
any) run t times on the same numbers, and each rank keeps their inputs for backward. Sequence
parallelism cuts those regions along the sequence instead: rank r holds tokens
[r S/t, (r+1) S/t) of them. LayerNorm and residual adds treat every token on its own, so
nothing else changes -- only the two operators at the borders:

    g-bar   = gather_from_sequence_parallel      forward: all-gather the sequence   backward: reduce-scatter
    g-bar^T = reduce_scatter_to_sequence_parallel forward: reduce-scatter sequence  backward: all-gather

One block on one rank ([S/t]: this rank's tokens, all h features; [S]: every token, 1/t of
the heads or of the ffn features). The four collectives sit at (1)-(4):

     [S/t]         (1)        [S]                                  (2)         [S/t]
    x ─┬─► LN ─── g-bar ──► Q, K, V ─► attention ─► out-proj ─── g-bar^T ──► + bias ─► (+) ─► x
       └─────────────────────────────────────────────────────────────────────────────────┘
    x ─┬─► LN ─── g-bar ──► up ─► GELU ─► down ───────────────── g-bar^T ──► + bias ─► (+) ─► out
       └─────────────────────────────────────────────────────────────────────────────────┘
     [S/t]         (3)        [S]                                  (4)         [S/t]

    on S/t tokens: both LayerNorms, both residual adds, the row-parallel layers' biases
    (and dropout, in a model that has it); on S tokens: everything between g-bar and g-bar^T.

Where TP puts f (identity / allreduce) and g (allreduce / identity), SP puts g-bar and g-bar^T:
4 collectives per block forward (2 all-gathers, 2 reduce-scatters), 4 backward (the reverse).
A ring allreduce IS a reduce-scatter followed by an all-gather, so the bytes are the same --
(t-1)/t n for each reduce-scatter or all-gather of an n-byte activation, 2 (t-1)/t n for each
TP allreduce -- and every rank's saved activations shrink by t (``activations`` in
``minidist.memory``: sbh/t (34 + 5as/h) per layer instead of sbh (10 + 24/t + 5as/(ht))).

Two prices, both paid here:

- A replicated parameter used on a shard of the tokens (the LayerNorms' weight and bias, the
  row-parallel layers' biases, now added after the reduce-scatter) gets only its shard's share
  of the gradient; the TP group must sum them -- ``sum_grads_over_tensor_parallel`` (f applied
  to the parameters: one allreduce per LayerNorm (2h numbers) and per bias (h) in backward,
  counted with TP's allreduces). Megatron sums them in one go after backward instead. (The
  position table is gathered instead: ``scatter_to_sequence_parallel`` of its S rows.)
- The layer after g-bar needs the gathered input again for its weight gradient. Keeping it costs
  e·sbh per rank (e bytes an element); ``gather_and_linear`` (the default, as Megatron) keeps
  only the S/t shard and all-gathers it once more in backward: one more all-gather per g-bar,
  and the 1/t above. ``keep_gathered=True`` keeps the gathered input: TP's bytes exactly (plus
  the small allreduces above), e·sbh (1 - 1/t) more saved per g-bar.

All sequence-parallel all-gathers and reduce-scatters are issued, and counted, in this file
(``count_sequence_collectives``); the sequence is dimension 1 of (batch, seq, hidden).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minidist import collectives as _collectives

from ...comm import Communicator
from .operators import _allreduce

__all__ = [
    "SequenceParallelLayerNorm",
    "check_sequence_divisible",
    "count_sequence_collectives",
    "gather_and_linear",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
    "reset_sequence_collective_counts",
    "scatter_to_sequence_parallel",
    "sum_grads_over_tensor_parallel",
]

SEQ_DIM = 1  # (batch, seq, hidden)

# --- counting -----------------------------------------------------------------------------------
_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _zero_counts() -> dict:
    return {phase: {"allgather": 0, "reduce_scatter": 0} for phase in ("forward", "backward")}


def count_sequence_collectives(comm: Communicator) -> dict:
    """Sequence-parallel collectives issued on ``comm`` since the last reset (a copy):
    ``{"forward": {"allgather": n, "reduce_scatter": n}, "backward": {...}}``."""
    counts = _COUNTS.setdefault(comm, _zero_counts())
    return {phase: dict(ops) for phase, ops in counts.items()}


def reset_sequence_collective_counts(comm: Communicator) -> None:
    """Set the counts of ``comm`` back to zero."""
    _COUNTS[comm] = _zero_counts()


def _count(comm: Communicator, phase: str, op: str) -> None:
    _COUNTS.setdefault(comm, _zero_counts())[phase][op] += 1


# --- the collectives along the sequence -----------------------------------------------------------
def check_sequence_divisible(seq_len: int, comm: Communicator) -> int:
    """``seq_len // t``, or a ValueError saying what to do."""
    t = comm.world_size
    if seq_len % t:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by the tensor-parallel degree {t}: sequence "
            f"parallelism gives each rank seq_len / {t} tokens; pad the sequence to a multiple of {t} "
            "or turn sequence_parallel off"
        )
    return seq_len // t


def _gather_seq(comm: Communicator, x: torch.Tensor, phase: str) -> torch.Tensor:
    """(B, S/t, h) on each rank -> (B, S, h), ranks in order: (t-1)/t of the result sent per rank."""
    if comm.world_size == 1:
        return x
    _count(comm, phase, "allgather")
    gathered = _collectives.allgather(comm, x.contiguous())  # (t, B, S/t, h)
    return torch.cat(gathered.unbind(0), dim=SEQ_DIM)


def _reduce_scatter_seq(comm: Communicator, x: torch.Tensor, phase: str) -> torch.Tensor:
    """(B, S, h) partial sums -> this rank's (B, S/t, h) of their sum: (t-1)/t of the input sent."""
    if comm.world_size == 1:
        return x
    check_sequence_divisible(x.shape[SEQ_DIM], comm)
    _count(comm, phase, "reduce_scatter")
    # md.reduce_scatter splits dimension 0: bring the sequence to the front and back
    seq_first = x.movedim(SEQ_DIM, 0).contiguous()
    return _collectives.reduce_scatter(comm, seq_first).movedim(0, SEQ_DIM)


def _my_tokens(comm: Communicator, x: torch.Tensor) -> torch.Tensor:
    part = check_sequence_divisible(x.shape[SEQ_DIM], comm)
    return x.narrow(SEQ_DIM, comm.rank * part, part).contiguous()


class _GatherFromSequenceParallel(torch.autograd.Function):
    """g-bar: all-gather along the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return _gather_seq(comm, x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(ctx.comm, grad, "backward"), None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    """g-bar^T: reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return _reduce_scatter_seq(comm, x, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(ctx.comm, grad, "backward"), None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Keep this rank's tokens forward (no communication), all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator):
        ctx.comm = comm
        return _my_tokens(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(ctx.comm, grad, "backward"), None


def gather_from_sequence_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """g-bar: (B, S/t, h) -> (B, S, h) by an all-gather; backward reduce-scatters the gradient
    (each rank's columns-split layers contributed to every token's gradient: sum, keep mine)."""
    return _GatherFromSequenceParallel.apply(x, comm)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """g-bar^T: partial sums (B, S, h) -> this rank's tokens of their sum (B, S/t, h), by a
    reduce-scatter; backward all-gathers the gradient. Replaces g (allreduce) after a row-parallel layer."""
    return _ReduceScatterToSequenceParallel.apply(x, comm)


def scatter_to_sequence_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's S/t tokens of a tensor every rank holds whole; backward all-gathers the gradient."""
    return _ScatterToSequenceParallel.apply(x, comm)


# --- g-bar fused with the column-parallel layers after it ------------------------------------------
class _GatherAndLinear(torch.autograd.Function):
    """y_i = all_gather(x) W_iᵀ + b_i for several column-parallel layers sharing one input,
    saving only this rank's x (S/t tokens) and all-gathering it again in backward."""

    @staticmethod
    def forward(ctx, x, comm: Communicator, *weights_and_biases):
        weights, biases = weights_and_biases[0::2], weights_and_biases[1::2]
        ctx.comm, ctx.has_bias = comm, [b is not None for b in biases]
        total = _gather_seq(comm, x, "forward")
        ctx.save_for_backward(x, *weights)  # x: the S/t shard, not `total`
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        total = _gather_seq(ctx.comm, x, "backward")  # the price of having saved 1/t of it
        flat = total.reshape(-1, total.shape[-1])
        grad_total = sum(g @ w for g, w in zip(grads, weights, strict=True))
        param_grads = []
        for g, has_bias in zip(grads, ctx.has_bias, strict=True):
            g = g.reshape(-1, g.shape[-1])
            param_grads += [g.t() @ flat, g.sum(0) if has_bias else None]
        return (_reduce_scatter_seq(ctx.comm, grad_total, "backward"), None, *param_grads)


def gather_and_linear(
    x: torch.Tensor,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
    comm: Communicator,
    keep_gathered: bool = False,
) -> tuple[torch.Tensor, ...]:
    """g-bar then column-parallel linears: ``F.linear(all_gather(x), w, b)`` for each (w, b) in ``layers``.

    ``x`` (B, S/t, h): this rank's tokens; each output (B, S, d_out/t). One all-gather forward
    for all the layers (Q, K and V share it), one reduce-scatter of the summed input gradient
    backward. ``keep_gathered=False`` saves only ``x`` and all-gathers it again in backward
    (1 more all-gather, e·sbh·(t-1)/t less memory per rank); ``True`` saves the gathered
    input (the linears' own backward: exactly TP's bytes).
    """
    if keep_gathered:
        total = gather_from_sequence_parallel(x, comm)
        return tuple(F.linear(total, w, b) for w, b in layers)
    flat = [t for pair in layers for t in pair]
    return _GatherAndLinear.apply(x, comm, *flat)


# --- replicated parameters used on a shard of the tokens ------------------------------------------
class _SumGradsOverTensorParallel(torch.autograd.Function):
    """The parameters unchanged forward; backward one allreduce (sum) of all their gradients."""

    @staticmethod
    def forward(ctx, comm: Communicator, *params):
        ctx.comm = comm
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        summed = _allreduce(ctx.comm, torch.cat([g.reshape(-1) for g in grads]), "backward")
        return (None, *(part.view_as(g) for part, g in zip(summed.split([g.numel() for g in grads]), grads)))


def sum_grads_over_tensor_parallel(comm: Communicator, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """f for parameters: use the returned tensors in place of ``params``; their gradients are
    summed over the TP group in backward (one allreduce of all of them together, counted by
    ``count_collectives`` as a backward allreduce). For replicated weights applied to S/t tokens."""
    return _SumGradsOverTensorParallel.apply(comm, *params)


class SequenceParallelLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` on this rank's S/t tokens; weight and bias replicated, their gradients summed
    over the TP group (one allreduce of 2h numbers per LayerNorm in backward). Loads a dense
    LayerNorm's state_dict as it is (same names, same shapes)."""

    def __init__(self, hidden: int, comm: Communicator, eps: float = 1e-5, device=None) -> None:
        super().__init__(hidden, eps=eps, device=device)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = sum_grads_over_tensor_parallel(self.comm, self.weight, self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)
