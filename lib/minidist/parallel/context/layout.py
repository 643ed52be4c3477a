"""Which tokens each rank holds: the contiguous and the zig-zag layouts of a sequence.

Context parallelism splits ONE sequence of S tokens over p ranks. The sequence is cut into
equal blocks, and a layout says which blocks each rank holds (dimension ``dim``, by default 2
of (batch, heads, seq, head_dim)):

    "contiguous"   p blocks of S/p; rank r holds block r.

                   blocks   0   1   2   3
                   rank     0   1   2   3                          (p = 4)

    "zigzag"       2p blocks of S/(2p); rank r holds blocks r and 2p-1-r, in that order.

                   blocks   0   1   2   3   4   5   6   7
                   rank     0   1   2   3   3   2   1   0          (p = 4)

Why zig-zag: under a causal mask a query attends only to keys at or before it. With the
contiguous layout rank 0's queries see one block of keys and rank p-1's see all p, so the
last rank does p times the first's work and everyone waits for it. Pairing an early block
with a late one evens it out: rank r's two query blocks see r+1 and 2p-r key blocks, 2p+1 in
all, the same on every rank (``ring.tiles_per_rank`` counts them).

S must divide into the blocks (p of them, or 2p): ``check_sequence`` says so otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "LAYOUTS",
    "block_size",
    "blocks_of",
    "check_layout",
    "check_sequence",
    "gather_sequence",
    "num_blocks",
    "positions",
    "shard_sequence",
]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def num_blocks(world_size: int, layout: str) -> int:
    """Blocks the sequence is cut into: p (contiguous) or 2p (zig-zag)."""
    check_layout(layout)
    return world_size if layout == "contiguous" else 2 * world_size


def blocks_of(rank: int, world_size: int, layout: str) -> tuple[int, ...]:
    """The global block indices rank ``rank`` holds, in the order its shard stores them."""
    if layout == "contiguous":
        return (rank,)
    check_layout(layout)
    return (rank, 2 * world_size - 1 - rank)


def check_sequence(seq_len: int, world_size: int, layout: str) -> None:
    """Raise a clear error unless ``seq_len`` tokens cut into the layout's equal blocks."""
    n = num_blocks(world_size, layout)
    if seq_len < n or seq_len % n:
        raise ValueError(
            f"layout {layout!r} on {world_size} ranks cuts the sequence into {n} equal blocks, but "
            f"the sequence has {seq_len} tokens: pad it to a multiple of {n}"
        )


def block_size(seq_len: int, world_size: int, layout: str) -> int:
    """Tokens in one block: S/p (contiguous) or S/(2p) (zig-zag)."""
    check_sequence(seq_len, world_size, layout)
    return seq_len // num_blocks(world_size, layout)


def positions(rank: int, world_size: int, seq_len: int, layout: str) -> torch.Tensor:
    """Global positions (int64) of the tokens in rank ``rank``'s shard, in its order."""
    size = block_size(seq_len, world_size, layout)
    return torch.cat([torch.arange(b * size, (b + 1) * size) for b in blocks_of(rank, world_size, layout)])


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 2
) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` along ``dim`` (a new contiguous tensor)."""
    seq_len = x.shape[dim]
    check_sequence(seq_len, world_size, layout)
    return x.index_select(dim, positions(rank, world_size, seq_len, layout).to(x.device)).contiguous()


def gather_sequence(shards: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's shard (``shards[r]`` from rank r): undoes ``shard_sequence``."""
    p = len(shards)
    seq_len = sum(s.shape[dim] for s in shards)
    check_sequence(seq_len, p, layout)
    order = torch.cat([positions(r, p, seq_len, layout) for r in range(p)])
    stacked = torch.cat(list(shards), dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len)
    return stacked.index_select(dim, inverse.to(stacked.device))
