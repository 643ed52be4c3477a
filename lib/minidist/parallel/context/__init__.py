"""Context parallelism: one long sequence split over p ranks, attention computed anyway.

Everything in a transformer layer but attention works token by token, so splitting the
sequence over ranks splits that work and its activations for free. Attention is the exception:
every query needs every key. Two ways to bring them together, side by side here:

    ring_attention      K/V shards travel a ring (p-1 steps), each step's transfer overlapped
                        with the compute on the shard in hand; partial results merged with the
                        online-softmax rule. Any p; causal work balanced by the zig-zag layout.
    ulysses_attention   all-to-all from "my tokens, all heads" to "all tokens, my heads",
                        ordinary attention, all-to-all back. 4 all-to-alls per forward, not
                        overlapped; p must divide the number of heads.

    from minidist.parallel import context
    q_local = context.shard_sequence(q, comm.rank, comm.world_size, layout="zigzag")   # (b, a, S/p, d)
    out = context.ring_attention(q_local, k_local, v_local, comm, causal=True, layout="zigzag")
    out = context.ulysses_attention(q_local, k_local, v_local, comm, causal=True, layout="zigzag")
    full = context.gather_sequence([out_0, ..., out_{p-1}], layout="zigzag")         # (b, a, S, d)

One idea per module, in reading order:

    online_softmax  attend_tile, merge (the log-sum-exp rule), tile_backward
    layout          the contiguous and zig-zag layouts: shard_sequence, gather_sequence, positions
    ring            ring_attention (an autograd Function whose backward runs the ring again),
                    RingCounter (tiles and FLOPs a rank computed)
    ulysses         ulysses_attention, AllToAll (autograd through md.all_to_all)
    costs           what each costs: tiles per rank, bytes per rank, alpha-beta time per layer

Shapes: q, k, v are (batch, heads, local_seq, head_dim) on every rank, local_seq = S/p.
"""

from .costs import (
    attention_flops,
    ring_bytes,
    ring_time,
    tiles_per_rank,
    ulysses_bytes,
    ulysses_time,
)
from .layout import (
    LAYOUTS,
    block_size,
    blocks_of,
    check_sequence,
    gather_sequence,
    num_blocks,
    positions,
    shard_sequence,
)
from .online_softmax import attend_tile, merge, tile_backward
from .ring import RingCounter, ring_attention
from .ulysses import ulysses_attention

__all__ = [
    "LAYOUTS",
    "RingCounter",
    "attend_tile",
    "attention_flops",
    "block_size",
    "blocks_of",
    "check_sequence",
    "gather_sequence",
    "merge",
    "num_blocks",
    "positions",
    "ring_attention",
    "ring_bytes",
    "ring_time",
    "shard_sequence",
    "tile_backward",
    "tiles_per_rank",
    "ulysses_attention",
    "ulysses_bytes",
    "ulysses_time",
]
