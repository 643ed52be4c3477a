"""The vocabulary split over the ranks: the embedding table by rows, the logits by columns.

Two pieces: ``VocabParallelEmbedding`` (each rank owns V/p rows of the table;
ids outside its range give zero, then g sums) and ``vocab_parallel_cross_entropy`` (the loss of
logits split along the vocabulary, computed with two small allreduces -- the row maximum and
[sum of exponentials, target logit] -- without ever gathering the (tokens, V) logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...comm import Communicator
from .layers import _copy_shard, check_divisible
from .operators import _allreduce, reduce_from_tensor_parallel
from .sequence import reduce_scatter_to_sequence_parallel

__all__ = ["IGNORE_INDEX", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: rank r holds ids [r V/p, (r+1) V/p).

    Each rank looks up the ids it owns and writes zeros for the others; g sums the ranks'
    results, so every position ends with exactly one non-zero contribution: 1 allreduce forward,
    none backward (each rank's rows get the gradient of the ids they own).
    ``sequence_parallel=True``: g-bar^T (reduce-scatter along the sequence) in place of g, so the
    output is this rank's S/p tokens; 1 reduce-scatter forward, 1 all-gather backward.
    """

    def __init__(self, vocab: int, d: int, comm: Communicator, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.comm, self.vocab, self.d = comm, vocab, d
        self.sequence_parallel = sequence_parallel
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
        reduce = (
            reduce_scatter_to_sequence_parallel if self.sequence_parallel else reduce_from_tensor_parallel
        )
        return reduce(x, self.comm)


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
