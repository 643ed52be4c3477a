"""Ring algorithms: reduce-scatter, allgather, and allreduce = one after the other.

The p ranks stand in a ring; each only ever sends to its right neighbour and
receives from its left one. The vector is cut into p chunks.

**reduce-scatter** (p-1 steps): in step s rank r sends chunk (r-s-1) and
receives chunk (r-s-2), adding it to its own copy. A chunk travels round the
ring collecting one contribution per hop; after p-1 hops rank r holds chunk r
summed over all ranks::

    p = 3, chunks a b c          step 0                 step 1
    rank 0: a0 b0 c0       sends c0 -> 1           sends b0+b2 -> 1
    rank 1: a1 b1 c1       sends a1 -> 2           sends c0+c1 -> 2
    rank 2: a2 b2 c2       sends b2 -> 0           sends a1+a2 -> 0
    result: rank 0 owns a0+a1+a2, rank 1 owns b, rank 2 owns c

**allgather** (p-1 steps): the same ring, passing finished chunks along until
every rank has all of them.

Cost per rank: 2(p-1) messages of n/p bytes, i.e. 2(p-1)/p * n bytes sent --
almost independent of p, which is why the ring is the bandwidth-optimal
allreduce -- but 2(p-1) latencies, which is why it loses for small vectors.
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from .ops import combine_


def ring_reduce_scatter_(comm: Communicator, flat: torch.Tensor, bounds, op: str, tag: int = 0) -> None:
    """In place on ``flat``: afterwards chunk ``rank`` (per ``bounds``) is reduced over all ranks."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    largest = max(hi - lo for lo, hi in bounds)
    incoming = torch.empty(largest, dtype=flat.dtype, device=flat.device)
    for step in range(p - 1):
        send_lo, send_hi = bounds[(r - step - 1) % p]
        recv_lo, recv_hi = bounds[(r - step - 2) % p]
        work = comm.isend(flat[send_lo:send_hi], right, tag)
        buffer = incoming[: recv_hi - recv_lo]
        comm.recv(buffer, left, tag)
        combine_(flat[recv_lo:recv_hi], buffer, op)
        work.wait()


def ring_allgather_(comm: Communicator, flat: torch.Tensor, bounds, tag: int = 0) -> None:
    """In place on ``flat``: rank r starts with chunk r, ends with every chunk."""
    p, r = comm.world_size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_lo, send_hi = bounds[(r - step) % p]
        recv_lo, recv_hi = bounds[(r - step - 1) % p]
        work = comm.isend(flat[send_lo:send_hi], right, tag)
        comm.recv(flat[recv_lo:recv_hi], left, tag)
        work.wait()
