"""Bytes each rank sends per bucket and step, for every hook (what ``comm.stats`` measures
on the point-to-point transports; the shm allreduce moves data through shared memory).

n entries, N ranks, k slots of DGC::

    dense float32, ring allreduce      2 (N-1)/N * n * 4      (below 8n for any N)
    bf16, ring allreduce               2 (N-1)/N * n * 2
    DGC, ring allgather of (v, index)  (N-1) * k * (4 + 4)    (grows with N)
    sign + scale, ring allgather       (N-1) * (4 + ceil(n/8))

The ring allreduce's chunks may differ by one entry between ranks, so its
formula holds for the average over ranks; the allgathers' hold for every rank.
At 99.9% sparsity (k = n/1000) the dense ring sends 8(N-1)/N n bytes and DGC
8(N-1) n/1000: 1000/N times fewer -- 500x for 2 ranks, 250x for 4 -- and the
advantage shrinks as 1/N: at N = 1000 ranks allgathering the sparse vectors
costs as much as the dense allreduce.
"""

from __future__ import annotations

import math


def dense_ring_bytes(numel: int, world_size: int, itemsize: int = 4) -> float:
    """Bytes sent per rank (average over ranks) by a ring allreduce of ``numel`` entries."""
    return 2 * (world_size - 1) / world_size * numel * itemsize


def sparse_allgather_bytes(slots: int, world_size: int) -> int:
    """Bytes sent per rank by the ring allgather of DGC's ``slots`` (value, index) pairs."""
    return (world_size - 1) * slots * 8


def sign_allgather_bytes(numel: int, world_size: int) -> int:
    """Bytes sent per rank by the ring allgather of 1-bit signs and one float32 scale."""
    return (world_size - 1) * (4 + math.ceil(numel / 8))


__all__ = ["dense_ring_bytes", "sign_allgather_bytes", "sparse_allgather_bytes"]
