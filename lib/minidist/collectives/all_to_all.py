"""All-to-all: every rank sends a different piece to every other rank (pairwise exchange).

Rank r holds p pieces, one per destination; afterwards rank r holds the p pieces
addressed to it, piece i from rank i. As a matrix of pieces (row = sender,
column = receiver), all-to-all is a *transpose*::

    before                        after
    rank 0: a0 a1 a2              rank 0: a0 b0 c0
    rank 1: b0 b1 b2     --->     rank 1: a1 b1 c1
    rank 2: c0 c1 c2              rank 2: a2 b2 c2

It is what a mixture-of-experts layer does twice per step (dispatch tokens to the
ranks that hold their experts, bring the results back) and what Ulysses attention
does to swap a sequence split for a head split.

**Pairwise exchange.** In step s = 1 .. p-1, rank r sends its piece for rank
(r+s) mod p and receives the piece of rank (r-s) mod p (its own piece it copies)::

    p = 4     step 1          step 2          step 3
              0->1 1->2       0->2 1->3       0->3 1->0
              2->3 3->0       2->0 3->1       2->1 3->2

In every step the sends form a *permutation*: each rank sends exactly one message
and receives exactly one. So no rank's link is asked to take two messages at once
(no contention: every link carries one piece per step, in each direction), and no
rank waits on a peer that is busy elsewhere. Deadlock: each step posts its send
with ``isend`` before the blocking ``recv``, and the rank it waits for has posted
its send to it in the same step, so every ``recv`` has a matching send -- for any
p, not only powers of two. (Posting all p-1 sends at once would also be correct
but would let p-1 messages race to one receiver.)

Cost per rank, pieces of m bytes (input n = p m bytes): p-1 messages,
(p-1) m = (p-1)/p n bytes sent (its own piece is copied, not sent);
time (p-1)(alpha + beta n/p) -- ``cost_model.predict("all_to_all", ...)``.

**Variable split** (MoE sends uneven token counts): the pieces may have different
first dimensions. A receiver must know each incoming size before it can receive it
(every message's header carries its shape), so unless the caller passes the sizes
(``recv_sizes=``, e.g. in a backward pass, which knows them from the forward), the
ranks first run the same pairwise exchange on the counts: p-1 more messages of one
int64 each, 8 (p-1) bytes and (p-1) alpha more time.
"""

from __future__ import annotations

import torch

from ..comm import Communicator


def pairwise_exchange(
    comm: Communicator, sends: list[torch.Tensor], recvs: list[torch.Tensor], tag: int = 0
) -> None:
    """Fill ``recvs[i]`` with rank i's ``sends[rank]`` (one list entry per rank).

    ``recvs[rank]`` gets a copy of ``sends[rank]``; every other piece travels in its
    own message, in the schedule above. ``recvs`` must be contiguous and shaped like
    what the peers send.
    """
    p, r = comm.world_size, comm.rank
    recvs[r].copy_(sends[r])
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        work = comm.isend(sends[dst], dst, tag)
        comm.recv(recvs[src], src, tag)
        work.wait()


def exchange_counts(comm: Communicator, counts: list[int], tag: int = 0) -> list[int]:
    """Tell rank j ``counts[j]``; return what every rank told this one (entry i from rank i).

    The all-to-all of the variable split's sizes: p-1 messages of 8 bytes.
    """
    sends = [torch.tensor([count], dtype=torch.int64) for count in counts]
    recvs = [torch.empty(1, dtype=torch.int64) for _ in counts]
    pairwise_exchange(comm, sends, recvs, tag)
    return [int(t) for t in recvs]


def all_to_all_equal(comm: Communicator, tensor: torch.Tensor, tag: int = 0) -> torch.Tensor:
    """Row j of ``tensor`` (shape (p, *chunk)) goes to rank j; row i of the result came from rank i."""
    source = tensor.detach().contiguous()  # a copy only when the input is not contiguous
    out = torch.empty(source.shape, dtype=source.dtype, device=source.device)
    pairwise_exchange(comm, list(source.unbind(0)), list(out.unbind(0)), tag)
    return out


def all_to_all_split(
    comm: Communicator, tensors: list[torch.Tensor], recv_sizes: list[int] | None = None, tag: int = 0
) -> list[torch.Tensor]:
    """Tensor j goes to rank j (any first dimension); entry i of the result came from rank i.

    ``recv_sizes[i]``: the first dimension rank i sends here; None exchanges them first.
    """
    sends = [t.detach().contiguous() for t in tensors]
    if recv_sizes is None:
        recv_sizes = exchange_counts(comm, [t.shape[0] for t in sends], tag)
    like = sends[comm.rank]
    recvs = [torch.empty((n, *like.shape[1:]), dtype=like.dtype, device=like.device) for n in recv_sizes]
    pairwise_exchange(comm, sends, recvs, tag)
    return recvs
