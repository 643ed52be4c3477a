"""Ring attention: the sequence split over p ranks, K/V blocks travelling a ring (Liu et al., 2023).

Every rank holds its shard of Q, K and V (``layout``: which blocks, see ``layout.py``). Each
rank's queries must meet every key, so the K/V shards travel: in step t rank r works on the
K/V shard of rank (r - t) mod p while it already passes that shard on to rank r+1 and receives
the next one from rank r-1 (isend/irecv posted BEFORE the compute, waited for after it: the
transfer hides behind the compute when the compute is the longer of the two):

    step 0            step 1            step 2            step 3            (p = 4)
    r0: KV0 -> r1     r0: KV3 -> r1     r0: KV2 -> r1     r0: KV1 (last: no send)
    r1: KV1 -> r2     r1: KV0 -> r2     r1: KV3 -> r2     r1: KV2
    r2: KV2 -> r3     r2: KV1 -> r3     r2: KV0 -> r3     r2: KV3
    r3: KV3 -> r0     r3: KV2 -> r0     r3: KV1 -> r0     r3: KV0

Each step's partial results (one per query block) are folded into a running (out, lse) with
the online-softmax rule ``merge``. A (query block, key block) pair is one *tile*; with
``causal=True`` a key block after the query block is skipped (nothing to see), the query's own
block is masked above its diagonal, an earlier one is computed whole.

Backward (``_RingAttention.backward``) runs the ring again. Forward saved only this rank's
q, k, v, out and lse -- never the other ranks' K/V, never a score matrix. Each K/V shard
travels once more, and beside it an accumulator dK/dV for that shard: every rank adds its
queries' contribution (``tile_backward``) and passes it on; after p steps the accumulator has
visited every rank and one last hop brings it home to the shard's owner.

Bytes sent per rank (B = bytes of one K-shaped shard, b a (S/p) d elements; K and V travel
as one message of 2B):
    forward   (p-1) x 2B                  p-1 messages
    backward  (p-1) x 2B + p x 2B         K/V for p-1 hops, dK/dV for p hops: 2p-1 messages
Memory. Saved for backward: q, k, v, out (4B) and lse -- 1/p of one rank's
(``memory.ring_attention_saved_bytes``). In flight: two K/V shards (the one in hand and the
incoming one); in backward also three dK/dV accumulators (this step's, the upstream one being
received, last step's still being sent). Scores: one tile at a time, (block x block) per
(batch, head) -- S/p x S/p contiguous, S/2p x S/2p zig-zag -- never the S x S matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minidist.clock import GPUSpec, wait
from minidist.comm import Communicator

from .layout import block_size, blocks_of, check_layout
from .online_softmax import attend_tile, merge, tile_backward

__all__ = ["RingCounter", "ring_attention"]

TAG_KV, TAG_GRAD_KV = 41, 42  # every message is checked against its tag: K/V and dK/dV never mix


@dataclass
class RingCounter:
    """What one rank computed: tiles (query block x key block products) and the largest one.

    ``tile_flops_*`` uses 4 m n d FLOPs per (batch, head) for a forward tile and 8 m n d for a
    backward one (a diagonal tile is computed whole, then masked). ``largest_tile`` is the
    biggest score matrix ever held, (m, n) per (batch, head).
    """

    tiles_forward: int = 0
    tiles_backward: int = 0
    flops_forward: int = 0
    flops_backward: int = 0
    largest_tile: tuple[int, int] = (0, 0)

    def _add(self, q: torch.Tensor, k: torch.Tensor, backward: bool) -> int:
        *batch_heads, m, d = q.shape
        n = k.shape[-2]
        flops = (8 if backward else 4) * m * n * d * int(torch.Size(batch_heads).numel())
        if backward:
            self.tiles_backward += 1
            self.flops_backward += flops
        else:
            self.tiles_forward += 1
            self.flops_forward += flops
        if m * n > self.largest_tile[0] * self.largest_tile[1]:
            self.largest_tile = (m, n)
        return flops


def _tiles(rank: int, owner: int, p: int, layout: str, causal: bool):
    """(i, j, diagonal) for the tiles rank ``rank`` computes against ``owner``'s K/V shard:
    i indexes its own blocks, j the owner's blocks (positions within the shards)."""
    for i, qb in enumerate(blocks_of(rank, p, layout)):
        for j, kb in enumerate(blocks_of(owner, p, layout)):
            if causal and kb > qb:
                continue  # the whole key block lies after the query block
            yield i, j, causal and kb == qb


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, causal, layout, scale, counter, gpu):
        p, r = comm.world_size, comm.rank
        size = block_size(q.shape[-2] * p, p, layout)
        q_blocks = q.split(size, dim=-2)
        acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(q_blocks)
        kv = torch.stack([k, v]).contiguous()  # one message per step: K and V together
        for step in range(p):
            if step < p - 1:  # pass this shard on and fetch the next one while computing
                incoming = torch.empty_like(kv)
                sent = comm.isend(kv, (r + 1) % p, TAG_KV)
                received = comm.irecv(incoming, (r - 1) % p, TAG_KV)
            owner = (r - step) % p
            k_blocks, v_blocks = kv[0].split(size, dim=-2), kv[1].split(size, dim=-2)
            for i, j, diagonal in _tiles(r, owner, p, layout, causal):
                part = attend_tile(q_blocks[i], k_blocks[j], v_blocks[j], scale, diagonal)
                acc[i] = part if acc[i] is None else merge(*acc[i], *part)
                flops = counter._add(q_blocks[i], k_blocks[j], backward=False)
                if gpu is not None:
                    wait(gpu.seconds(flops))
            if step < p - 1:
                sent.wait()
                received.wait()
                kv = incoming
        out = torch.cat([a[0] for a in acc], dim=-2)
        lse = torch.cat([a[1] for a in acc], dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.layout, ctx.scale = comm, causal, layout, scale
        ctx.counter, ctx.gpu, ctx.size = counter, gpu, size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        comm, size, scale = ctx.comm, ctx.size, ctx.scale
        p, r = comm.world_size, comm.rank
        nxt, prev = (r + 1) % p, (r - 1) % p
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(-1)  # D = rowsum(dO * O), with the final out
        q_blocks, go_blocks = q.split(size, dim=-2), grad_out.split(size, dim=-2)
        lse_blocks, delta_blocks = lse.split(size, dim=-1), delta.split(size, dim=-1)
        grad_q = torch.zeros_like(q)
        grad_q_blocks = grad_q.split(size, dim=-2)
        kv = torch.stack([k, v]).contiguous()
        in_flight: list = []  # last step's sends: waited for after this step's compute
        for step in range(p):
            # receive order = the sender's send order: its dK/dV of step t-1, then its K/V of step t
            if step > 0:  # the accumulator of the shard in hand: every earlier rank's share
                upstream = torch.empty_like(kv)
                upstream_work = comm.irecv(upstream, prev, TAG_GRAD_KV)
            sends = []
            if step < p - 1:
                incoming = torch.empty_like(kv)
                sends.append(comm.isend(kv, nxt, TAG_KV))
                incoming_work = comm.irecv(incoming, prev, TAG_KV)
            owner = (r - step) % p
            k_blocks, v_blocks = kv[0].split(size, dim=-2), kv[1].split(size, dim=-2)
            grad_kv = torch.zeros_like(kv)  # this rank's share for the shard in hand
            gk_blocks, gv_blocks = grad_kv[0].split(size, dim=-2), grad_kv[1].split(size, dim=-2)
            for i, j, diagonal in _tiles(r, owner, p, ctx.layout, ctx.causal):
                gq, gk, gv = tile_backward(
                    q_blocks[i], k_blocks[j], v_blocks[j], go_blocks[i], lse_blocks[i],
                    delta_blocks[i], scale, diagonal,
                )  # fmt: skip
                grad_q_blocks[i].add_(gq)
                gk_blocks[j].add_(gk)
                gv_blocks[j].add_(gv)
                flops = ctx.counter._add(q_blocks[i], k_blocks[j], backward=True)
                if ctx.gpu is not None:
                    wait(ctx.gpu.seconds(flops))
            for work in in_flight:
                work.wait()
            if step > 0:
                upstream_work.wait()
                grad_kv.add_(upstream)
            if p > 1:  # on to the next rank; after the last step that rank is the owner
                sends.append(comm.isend(grad_kv, nxt, TAG_GRAD_KV))
            if step < p - 1:
                incoming_work.wait()
                kv = incoming
            in_flight = sends
        if p > 1:  # our own shard's accumulator, home after visiting every rank
            grad_kv = torch.empty_like(kv)
            comm.irecv(grad_kv, prev, TAG_GRAD_KV).wait()
        for work in in_flight:
            work.wait()
        return grad_q, grad_kv[0], grad_kv[1], None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Communicator,
    causal: bool = True,
    layout: str = "zigzag",
    scale: float | None = None,
    counter: RingCounter | None = None,
    compute_clock: GPUSpec | None = None,
) -> torch.Tensor:
    """Softmax attention over the whole sequence, each rank holding its shard (see the module).

    q, k, v: (batch, heads, local_seq, head_dim), this rank's tokens in ``layout`` order
    (``shard_sequence(x, comm.rank, comm.world_size, layout)``), the same shape on every rank.
    Returns this rank's rows of softmax(scale q k^T [+ causal mask]) v, shaped like q; the
    sequence is the p shards put together (``gather_sequence``). ``scale`` defaults to
    1/sqrt(head_dim). Differentiable in q, k and v (the backward runs the ring again).

    ``counter``: a ``RingCounter`` to which this rank's tiles and FLOPs are added (forward now,
    backward when it runs). ``compute_clock``: each tile also takes the time this GPU would
    spend on its FLOPs (``minidist.clock``), for measurements on the emulated clock.
    """
    check_layout(layout)
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            "ring_attention takes q, k, v of one shape (batch, heads, local_seq, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    p = comm.world_size
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(
            f"the zig-zag layout gives each rank two blocks of S/(2p) tokens, so local_seq must be even, "
            f"got {q.shape[-2]}: pad the sequence to a multiple of 2p = {2 * p}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    counter = RingCounter() if counter is None else counter
    return _RingAttention.apply(q, k, v, comm, causal, layout, scale, counter, compute_clock)
