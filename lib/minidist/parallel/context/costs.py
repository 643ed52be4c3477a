"""What ring and Ulysses attention cost per rank: tiles, bytes, and alpha-beta time per layer.

Notation: b batch, a heads, S sequence, d head dimension, p ranks, e bytes an element;
B = b a (S/p) d e, the bytes of one rank's q (or k, or v) shard.

Tiles per rank (a tile = one query block x one key block, ``ring.RingCounter`` counts them):

    contiguous, not causal    p tiles of (S/p)^2        every rank meets every block
    contiguous, causal        r + 1 tiles on rank r     keys after the queries are skipped:
                                                        rank p-1 does p times rank 0's work
    zig-zag, not causal       4p tiles of (S/2p)^2      2 query blocks x 2p key blocks
    zig-zag, causal           2p + 1 on EVERY rank      query block r sees r+1 key blocks,
                                                        block 2p-1-r sees 2p-r: (r+1)+(2p-r)

(step 0, its own shard: 3 tiles; every other step: 2 -- so the ranks stay in step too.)

Bytes per rank (counted by the transports' ``stats``):

    ring      forward  (p-1) 2B  in p-1 messages             (K and V, one message a step)
              backward (p-1) 2B + p 2B  in 2p-1 messages      (K/V p-1 hops, dK/dV p hops)
    Ulysses   forward  4 (p-1) B/p  in 4 (p-1) messages       (q, k, v in; out back)
              backward the same                                (dout in; dq, dk, dv back)

Time per layer (forward), alpha-beta with one outgoing link per rank, compute from FLOPs:

    ring      step t: compute c_t on the shard in hand while the next one travels,
              m = alpha + 2B/bandwidth; a step ends when both are done:
              T = sum_{t < p-1} max(c_t, m) + c_{p-1}        (``ring_time`` walks the schedule)
    Ulysses   T = 4 (p-1) (alpha + B/(p bandwidth)) + C/p     (C: the layer's attention FLOPs
                                                               at the GPU's rate; no overlap)

Which wins: Ulysses sends p/2 times fewer bytes, so when communication dominates (a slow link,
a short sequence: compute grows as S^2, bytes as S) it wins; ring attention hides its
transfers behind compute once c_t > m, i.e. for long enough sequences, and then costs the
compute alone while Ulysses still pays its all-to-alls. Ulysses needs p <= a (p divides a).
"""

from __future__ import annotations

from minidist.clock import GPUSpec

from .layout import block_size, blocks_of, check_layout

__all__ = ["attention_flops", "ring_bytes", "ring_time", "tiles_per_rank", "ulysses_bytes", "ulysses_time"]


def tiles_per_rank(rank: int, world_size: int, layout: str, causal: bool) -> int:
    """Tiles rank ``rank`` computes in ring attention's forward (the table above)."""
    check_layout(layout)
    p = world_size
    if layout == "contiguous":
        return rank + 1 if causal else p
    return 2 * p + 1 if causal else 4 * p


def attention_flops(
    batch: int, heads: int, seq: int, head_dim: int, world_size: int, layout: str, causal: bool, rank: int
) -> int:
    """Forward FLOPs of rank ``rank`` in ring attention: tiles x 4 (block^2) d per (batch, head)."""
    blk = block_size(seq, world_size, layout)
    return tiles_per_rank(rank, world_size, layout, causal) * 4 * blk * blk * head_dim * batch * heads


def ring_bytes(
    batch: int, heads: int, seq: int, head_dim: int, world_size: int, element_size: int = 4
) -> dict[str, int]:
    """Bytes and messages one rank sends in ring attention (forward; backward)."""
    p = world_size
    shard = batch * heads * (seq // p) * head_dim * element_size  # B
    return {
        "forward": (p - 1) * 2 * shard,
        "forward_messages": p - 1,
        "backward": (p - 1) * 2 * shard + p * 2 * shard if p > 1 else 0,
        "backward_messages": 2 * p - 1 if p > 1 else 0,
    }


def ulysses_bytes(
    batch: int, heads: int, seq: int, head_dim: int, world_size: int, element_size: int = 4
) -> dict[str, int]:
    """Bytes and messages one rank sends in Ulysses attention (forward; backward)."""
    p = world_size
    shard = batch * heads * (seq // p) * head_dim * element_size  # B
    per_all_to_all = (p - 1) * shard // p
    return {
        "forward": 4 * per_all_to_all,
        "forward_messages": 4 * (p - 1),
        "backward": 4 * per_all_to_all,
        "backward_messages": 4 * (p - 1),
    }


def _step_flops(rank: int, step: int, p: int, layout: str, causal: bool, blk: int, per_pair: int) -> int:
    """Forward FLOPs of rank ``rank`` in ring step ``step`` (the K/V shard of rank - step)."""
    owner = (rank - step) % p
    tiles = sum(
        1
        for qb in blocks_of(rank, p, layout)
        for kb in blocks_of(owner, p, layout)
        if not (causal and kb > qb)
    )
    return tiles * 4 * blk * blk * per_pair


def ring_time(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    world_size: int,
    alpha_s: float,
    bandwidth_Bps: float,
    gpu: GPUSpec,
    causal: bool = False,
    layout: str = "zigzag",
    element_size: int = 4,
) -> float:
    """Predicted seconds of ring attention's forward: the slowest rank's finish.

    Walks the schedule: rank r starts step t+1 when its compute of step t is done, its send of
    step t has been delivered, and the shard from rank r-1 (sent at the start of r-1's step t)
    has arrived: m = alpha + 2B/bandwidth after it left. With the zig-zag layout every rank
    keeps step, and this is sum_{t<p-1} max(c_t, m) + c_{p-1}.
    """
    p = world_size
    blk = block_size(seq, p, layout)
    m = alpha_s + 2 * batch * heads * (seq // p) * head_dim * element_size / bandwidth_Bps
    per_pair = batch * heads * head_dim
    start = [0.0] * p
    for step in range(p):
        done = [
            start[r] + gpu.seconds(_step_flops(r, step, p, layout, causal, blk, per_pair)) for r in range(p)
        ]
        if step == p - 1:
            return max(done)
        start = [max(done[r], start[r] + m, start[(r - 1) % p] + m) for r in range(p)]
    return 0.0


def ulysses_time(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    world_size: int,
    alpha_s: float,
    bandwidth_Bps: float,
    gpu: GPUSpec,
    element_size: int = 4,
) -> float:
    """Predicted seconds of Ulysses attention's forward: 4 all-to-alls (pairwise exchange:
    p-1 messages of B/p each) plus the local attention, 4 b (a/p) S^2 d FLOPs, one after another."""
    p = world_size
    piece = batch * heads * (seq // p) * head_dim * element_size / p
    return 4 * (p - 1) * (alpha_s + piece / bandwidth_Bps) + gpu.seconds(
        4 * batch * (heads // p) * seq * seq * head_dim
    )
