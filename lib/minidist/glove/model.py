"""The GloVe model and its AdaGrad step (Pennington, Socher & Manning, 2014).

    L = sum_{i != j} f(X_ij) (w_i . c_j + b_i + b~_j - log X_ij)^2
    f(x) = (x / x_max)^alpha  for x < x_max,  1 otherwise   (alpha = 0.75)

The paper uses x_max = 100 on billions of tokens. On our 1.28M tokens most counts are
far below 100, so f would be ~0.03 for most pairs and 15 epochs would not get far;
we default to x_max = 10, the value of Stanford's ``demo.sh`` for small corpora.

**Layout** (as in Stanford's ``glove.c``): one table of ``2V`` rows of ``dim + 1``
floats. Row ``i`` is word ``i``'s vector ``w_i`` with its bias ``b_i`` in the last
column; row ``V + j`` is context ``j``'s vector ``c_j`` and bias ``b~_j``. A pair
(i, j) touches exactly two rows, ``i`` and ``V + j`` -- that sparsity is what the
parallel trainers of this track exploit. The embedding of word ``i`` is ``w_i + c_i``.

**One step on a batch of B pairs** (``pair_gradients`` then ``adagrad_update``)::

    diff_k   = w_i . c_j + b_i + b~_j - log X_ij          (B numbers)
    loss     = sum_k  f_k diff_k^2 / 2                     (glove.c reports its mean)
    g(row i)     = f_k diff_k * [c_j, 1]                   (2B gradient rows)
    g(row V + j) = f_k diff_k * [w_i, 1]
    row     -= lr * g / sqrt(G[row])    G[row] += g * g    (AdaGrad, G starts at 1)

Every pair reads ``G`` as it was at the start of the batch, and updates of rows that
occur several times in a batch add up. So the result of a step does not depend on
the order of the pairs in the batch -- which is what lets a synchronous parallel
step (each worker a part of the batch, updates combined) equal the single-process
one up to floating-point rounding. With B = 1 this is per-pair AdaGrad as in the
paper, with glove.c's clipping of ``f diff`` to [-100, 100]. (glove.c itself
accumulates the squares of ``lr * g`` rather than of ``g``, a larger effective step;
we keep textbook AdaGrad and a larger lr instead.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .cooccur import Cooccurrence

X_MAX = 10.0
ALPHA = 0.75
GRAD_CLIP = 100.0  # glove.c clips f * diff to [-100, 100]


@dataclass(frozen=True)
class GloveConfig:
    """Hyper-parameters shared by every trainer (glove.c's defaults, except lr and x_max)."""

    dim: int = 50
    lr: float = 0.1  # glove.c: 0.05; 0.1 gets further in 15 epochs on our small corpus
    x_max: float = X_MAX
    batch_size: int = 2048
    epochs: int = 15
    seed: int = 0


DEFAULT_CONFIG = GloveConfig()


def weighting(x: torch.Tensor, x_max: float = X_MAX) -> torch.Tensor:
    """f(x) = (x / x_max)^alpha below x_max, 1 above."""
    return torch.where(x < x_max, (x / x_max) ** ALPHA, torch.ones_like(x))


@dataclass
class Pairs:
    """The training set: the nonzero co-occurrences as parallel arrays.

    ``rows`` is the word's table row ``i``, ``cols`` the context's table row ``V + j``
    (already offset), ``log_x`` and ``f_x`` are precomputed per pair.
    """

    rows: torch.Tensor  # int64
    cols: torch.Tensor  # int64
    log_x: torch.Tensor  # float32
    f_x: torch.Tensor  # float32
    vocab_size: int

    @classmethod
    def from_cooccurrence(cls, cooc: Cooccurrence, x_max: float = X_MAX) -> Pairs:
        x = torch.from_numpy(cooc.counts)
        return cls(
            rows=torch.from_numpy(cooc.rows).clone(),
            cols=torch.from_numpy(cooc.cols) + cooc.vocab_size,
            log_x=x.log().float(),
            f_x=weighting(x, x_max).float(),
            vocab_size=cooc.vocab_size,
        )

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, index: torch.Tensor | slice) -> Pairs:
        return Pairs(self.rows[index], self.cols[index], self.log_x[index], self.f_x[index], self.vocab_size)

    def shuffled(self, seed: int) -> Pairs:
        """A fixed permutation (glove.c shuffles its pairs once, before training)."""
        return self.subset(torch.randperm(len(self), generator=torch.Generator().manual_seed(seed)))

    def share_memory_(self) -> Pairs:
        for t in (self.rows, self.cols, self.log_x, self.f_x):
            t.share_memory_()
        return self


def init_table(vocab_size: int, dim: int, seed: int = 0) -> torch.Tensor:
    """Uniform in [-0.5/dim, 0.5/dim), biases included (as glove.c)."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.rand(2 * vocab_size, dim + 1, generator=generator) - 0.5) / dim


def init_gradsq(vocab_size: int, dim: int) -> torch.Tensor:
    """AdaGrad's sums of squared gradients, starting at 1 (as glove.c)."""
    return torch.ones(2 * vocab_size, dim + 1)


def pair_gradients(
    vectors: torch.Tensor, log_x: torch.Tensor, f_x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient rows for a batch, given ``vectors = table[cat(rows, cols)]`` (2B x (dim+1)).

    Returns ``(grads, loss)``: ``grads[k]`` belongs to table row ``cat(rows, cols)[k]``;
    ``loss`` is the batch's summed ``f diff^2 / 2`` (a 0-d tensor).
    """
    batch, dim = len(log_x), vectors.shape[1] - 1
    word, context = vectors[:batch], vectors[batch:]
    diff = torch.einsum("bd,bd->b", word[:, :dim], context[:, :dim]) + word[:, dim] + context[:, dim] - log_x
    fdiff = f_x * diff
    loss = torch.dot(fdiff, diff) / 2
    fdiff.clamp_(-GRAD_CLIP, GRAD_CLIP)
    grads = torch.cat([context, word])  # d(diff)/d(w_i) = [c_j, 1], d(diff)/d(c_j) = [w_i, 1]
    grads[:, dim] = 1.0
    grads.mul_(fdiff.repeat(2)[:, None])
    return grads, loss


def adagrad_update(
    table: torch.Tensor, gradsq: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float
) -> None:
    """``table[rows] -= lr * grads / sqrt(gradsq[rows])``, then ``gradsq[rows] += grads^2``.

    Repeated rows add up (``index_add_``); ``grads`` is overwritten. Two choices for speed
    (same arithmetic, measured on one thread): rows are read with ``index_select``, which
    gathers whole rows (``gradsq[rows]`` goes through torch's general advanced indexing, about
    1.3x slower per batch step); and the step is scaled by ``-lr`` before ``index_add_``, whose
    ``alpha=`` argument sends it down a slower loop (about 2.5x slower for 4096 rows of 51).
    """
    step = grads / gradsq.index_select(0, rows).sqrt_()
    table.index_add_(0, rows, step.mul_(-lr))
    gradsq.index_add_(0, rows, grads.square_())


def batch_step(table: torch.Tensor, gradsq: torch.Tensor, batch: Pairs, lr: float) -> float:
    """One AdaGrad step on ``batch``; returns its summed loss."""
    rows = torch.cat([batch.rows, batch.cols])
    grads, loss = pair_gradients(table.index_select(0, rows), batch.log_x, batch.f_x)
    adagrad_update(table, gradsq, rows, grads, lr)
    return float(loss)


def full_loss(table: torch.Tensor, pairs: Pairs, chunk: int = 1 << 18) -> float:
    """Mean ``f diff^2 / 2`` over all pairs (glove.c's "cost"), without updating anything."""
    total = 0.0
    for start in range(0, len(pairs), chunk):
        part = pairs.subset(slice(start, start + chunk))
        rows = torch.cat([part.rows, part.cols])
        _, loss = pair_gradients(table.index_select(0, rows), part.log_x, part.f_x)
        total += float(loss)
    return total / max(len(pairs), 1)


def embeddings(table: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Word vectors ``w_i + c_i`` (biases dropped), as glove.c's default output."""
    dim = table.shape[1] - 1
    return (table[:vocab_size, :dim] + table[vocab_size:, :dim]).numpy().astype(np.float32)
