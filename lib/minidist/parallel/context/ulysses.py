"""Ulysses attention (Jacobs et al., 2023): trade the sequence split for a head split, and back.

Heads never talk to each other, so attention needs every token only of ITS head. Each rank
starts with its S/p tokens of all a heads; one all-to-all hands every rank all S tokens of
a/p heads; plain attention runs locally; a second all-to-all returns each rank its tokens:

    before: rank r holds tokens T_r of heads 0..a-1        (b, a, S/p, d)
                  heads  H_0  H_1  H_2  H_3                 all-to-all = transpose of the
    rank 0:  T_0 [ x00  x01  x02  x03 ]                     (rank, head group) matrix:
    rank 1:  T_1 [ x10  x11  x12  x13 ]     --->            rank j gets column j
    ...                                                     (b, a/p, S, d)
    after: rank j holds tokens T_0..T_{p-1} of head group H_j

Forward: 4 all-to-alls (q, k, v in; out back), each sending (p-1)/p of a q-sized shard
(B = b a (S/p) d elements), in p-1 messages: 4 (p-1) B/p bytes per rank. Backward: the same 4
in reverse (an all-to-all's backward is an all-to-all: sending row i back to rank i undoes
it). Nothing overlaps the compute here, and p must divide the heads -- the two limits ring
attention does not have. Memory: local attention on the full sequence, S x S scores for a/p
heads on each rank (our local kernel, torch's scaled_dot_product_attention, may hold them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minidist.clock import GPUSpec, wait
from minidist.collectives import all_to_all
from minidist.comm import Communicator

from .layout import check_sequence, positions

__all__ = ["AllToAll", "heads_to_sequence", "sequence_to_heads", "ulysses_attention"]


class AllToAll(torch.autograd.Function):
    """``md.all_to_all`` of a (world_size, *chunk) tensor, differentiable: backward is the
    same all-to-all of the gradient (row i goes back to rank i, where it came from)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return all_to_all(comm, x.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(ctx.comm, grad.contiguous()), None


def _order(comm: Communicator, local_seq: int, layout: str) -> torch.Tensor:
    """Global positions of the tokens as they arrive (rank 0's shard, then rank 1's, ...)."""
    p = comm.world_size
    return torch.cat([positions(r, p, local_seq * p, layout) for r in range(p)])


def sequence_to_heads(x: torch.Tensor, comm: Communicator, layout: str = "contiguous") -> torch.Tensor:
    """(b, a, S/p, d) this rank's tokens, all heads -> (b, a/p, S, d) all tokens (in sequence
    order), heads [rank a/p, (rank+1) a/p). One all-to-all."""
    b, a, s, d = x.shape
    p = comm.world_size
    pieces = x.reshape(b, p, a // p, s, d).transpose(0, 1)  # row j: head group j, for rank j
    got = AllToAll.apply(pieces, comm)  # row i: rank i's tokens of my head group
    full = got.permute(1, 2, 0, 3, 4).reshape(b, a // p, p * s, d)
    if layout == "contiguous":
        return full
    inverse = torch.argsort(_order(comm, s, layout)).to(x.device)
    return full.index_select(2, inverse)


def heads_to_sequence(y: torch.Tensor, comm: Communicator, layout: str = "contiguous") -> torch.Tensor:
    """The inverse of ``sequence_to_heads``: (b, a/p, S, d) -> (b, a, S/p, d). One all-to-all."""
    b, heads, seq, d = y.shape
    p = comm.world_size
    s = seq // p
    if layout != "contiguous":
        y = y.index_select(2, _order(comm, s, layout).to(y.device))  # rank 0's shard first, ...
    pieces = y.reshape(b, heads, p, s, d).permute(2, 0, 1, 3, 4)  # row j: rank j's tokens
    got = AllToAll.apply(pieces, comm)  # row i: head group i of my tokens
    return got.transpose(0, 1).reshape(b, heads * p, s, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Communicator,
    causal: bool = True,
    layout: str = "contiguous",
    scale: float | None = None,
    compute_clock: GPUSpec | None = None,
) -> torch.Tensor:
    """Softmax attention over the whole sequence by two all-to-alls over heads (see the module).

    q, k, v: (batch, heads, local_seq, head_dim), this rank's tokens in ``layout`` order, the
    same shape on every rank; heads must be a multiple of p. Returns this rank's rows of the
    attention output, shaped like q. Differentiable (autograd through the all-to-alls).
    ``compute_clock``: the local attention also takes the time this GPU would spend on its
    4 b (a/p) S^2 d FLOPs (the whole score matrix, as our local kernel computes it).
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "ulysses_attention takes q, k, v of one shape (batch, heads, local_seq, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    b, a, s, d = q.shape
    p = comm.world_size
    if a % p:
        raise ValueError(
            f"Ulysses gives each of the {p} ranks a/p whole heads, but there are {a} heads: use a "
            f"number of ranks that divides {a}, or ring_attention (any number of ranks)"
        )
    check_sequence(s * p, p, layout)
    qh, kh, vh = (sequence_to_heads(t, comm, layout) for t in (q, k, v))
    if compute_clock is not None:
        wait(compute_clock.seconds(4 * b * (a // p) * (s * p) ** 2 * d))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return heads_to_sequence(out, comm, layout)
