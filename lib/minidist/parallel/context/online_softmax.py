"""Attention one tile at a time, and the rule that merges two partial results (online softmax).

Attention of one query row q over keys k_1..k_n with values v_1..v_n (scale c = 1/sqrt(d)):

    out = sum_j exp(c q.k_j) v_j / Z          Z = sum_j exp(c q.k_j)       lse = log Z

Split the keys into two sets A and B (two blocks of the sequence, held by two ranks). Each set
gives its own normalised result and its own log-sum-exp:

    out_A = sum_{j in A} exp(c q.k_j) v_j / Z_A          lse_A = log Z_A
    out_B = ...                                          lse_B = log Z_B

The result over the union needs no second look at the keys. Since Z = Z_A + Z_B:

    lse = log(exp(lse_A) + exp(lse_B))                  (torch.logaddexp: no overflow)
    out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

-- each partial result re-weighted by its share Z_A / Z of the normaliser. The merge is
associative and commutative, so the blocks may arrive in any order: that is what lets K/V
blocks travel a ring while every rank keeps one running (out, lse) per query row. It is the
"online softmax" of Milakov and Gimelshein (2018), the inner loop of FlashAttention.

Backward of one tile, from the final (out, lse) of the query rows (no need for the others):

    P  = exp(c q k^T - lse)          the tile's share of the final softmax (recomputed)
    dV = P^T dO                      dP = dO V^T
    dS = P * (dP - D)                D = rowsum(dO * out): the softmax's correction, one per row
    dQ = c dS K                      dK = c dS^T Q

Summing these over the tiles gives the gradient of full attention: each tile's P is exactly
its block of the full softmax, because the lse used is the full row's.

Cost of one (m queries) x (n keys) tile, head dimension d, per (batch, head): forward
4 m n d FLOPs (QK^T and PV), backward 8 m n d (recomputing QK^T, then dV, dP, dQ, dK);
memory: one m x n score matrix at a time.
"""

from __future__ import annotations

import torch

__all__ = ["attend_tile", "merge", "tile_backward"]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal_diagonal: bool) -> torch.Tensor:
    """c q k^T for one tile; with ``causal_diagonal`` (queries and keys at the same positions)
    the entries above the diagonal (key after query) are -inf."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal_diagonal:
        m, n = scores.shape[-2:]
        future = torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def attend_tile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_diagonal: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries ``q`` (..., m, d) over one key block ``k``, ``v`` (..., n, d).

    Returns ``(out, lse)``: out (..., m, d) normalised over this block only, lse (..., m) the
    log of its normaliser. ``causal_diagonal``: the block is the queries' own block, so query i
    sees keys 0..i only (every row keeps at least its own key: no row is empty).
    """
    scores = _scores(q, k, scale, causal_diagonal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over keys A and B from attention over A and over B (see the module docstring).

    ``out_*`` (..., m, d), ``lse_*`` (..., m). Exact up to rounding: merge(attend(A), attend(B))
    equals attend(A + B), in any order and grouping.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
    return out, lse


def tile_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    causal_diagonal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's share of (dQ, dK, dV), given the queries' FINAL ``lse`` and
    ``delta = (grad_out * out).sum(-1)`` with the final out (see the module docstring)."""
    probs = torch.exp(_scores(q, k, scale, causal_diagonal) - lse.unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
    grad_probs = torch.matmul(grad_out, v.transpose(-2, -1))
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
    return grad_q, grad_k, grad_v
