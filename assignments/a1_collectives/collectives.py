"""Assignment 1: collectives built from point-to-point messages.

You write five collective operations with nothing but the four point-to-point calls of a
minidist communicator::

    comm.send(t, dst)        # blocks until t may be reused
    comm.recv(t, src)        # fills t in place (same shape and dtype as the sender's tensor)
    h = comm.isend(t, dst)   # returns at once; h.wait() before you modify t
    h = comm.irecv(t, src)   # returns at once; h.wait() before you read t

plus ``comm.rank`` and ``comm.world_size``. No ``md.allreduce``, no ``torch.distributed``:
the point is to see every byte move.

=====  ========================  =====================================================
task   function                  what every rank holds afterwards
=====  ========================  =====================================================
1      ``tree_broadcast``        the source rank's tensor (in place)
2      ``ring_allgather``        returns every rank's tensor, stacked
3      ``ring_reduce_scatter``   returns its own block of the sum of all inputs
4      ``ring_allreduce``        the sum of all ranks' tensors (in place)
5      ``butterfly_allreduce``   the same sum, in log2(p) steps instead of p - 1
=====  ========================  =====================================================

Notation in the docstrings: ``p`` is ``comm.world_size``, ``n`` the size of a rank's tensor
in bytes, ``alpha`` the latency of one message and ``beta`` the time per byte, so a message
of ``m`` bytes costs ``alpha + m * beta``.

The tests do not only check the values: they read ``comm.stats`` around each call and check
that every rank sends exactly the bytes and messages the algorithm of the docstring sends. A
ring allreduce that gathers everything on rank 0 and broadcasts the sum is correct, and still
fails. Calling the library's collectives (``md.allreduce`` and friends) or torch's scores 0.

Work on this file, then run the public tests from this folder::

    python -m pytest -q test_a1_collectives.py

Grep for ``TODO(task`` to find what is left to do.
"""

from __future__ import annotations

import torch

from minidist import Communicator

__all__ = [
    "butterfly_allreduce",
    "chunk_offsets",
    "exchange",
    "ring_allgather",
    "ring_allreduce",
    "ring_reduce_scatter",
    "tree_broadcast",
]


# --- given helpers: use them, you do not need to change them ----------------------------
def chunk_offsets(numel: int, parts: int) -> list[int]:
    """Split ``numel`` elements into ``parts`` contiguous chunks, as equal as possible.

    Returns ``parts + 1`` offsets: chunk ``i`` is ``flat[offsets[i] : offsets[i + 1]]``.
    The first ``numel % parts`` chunks are one element longer than the others, so sizes
    differ by at most one; with ``numel < parts`` the last chunks are empty::

        >>> chunk_offsets(10, 4)
        [0, 3, 6, 8, 10]
        >>> chunk_offsets(2, 4)
        [0, 1, 2, 2, 2]
    """
    base, extra = divmod(numel, parts)
    offsets = [0]
    for i in range(parts):
        offsets.append(offsets[-1] + base + (1 if i < extra else 0))
    return offsets


def exchange(comm: Communicator, send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int) -> None:
    """Send ``send_buf`` to ``dst`` and, at the same time, receive ``recv_buf`` from ``src``.

    Why not ``comm.send(...)`` followed by ``comm.recv(...)``? In a ring every rank sends at
    the same moment. A blocking send of a large message returns only once the receiver has
    taken (most of) it -- and the receiver is itself stuck in *its* send: a deadlock. Posting
    the send asynchronously first lets every rank go on to its receive.
    ``send_buf`` and ``recv_buf`` must not overlap.
    """
    work = comm.isend(send_buf, dst)
    comm.recv(recv_buf, src)
    work.wait()


# --- task 1 ------------------------------------------------------------------------------
def tree_broadcast(comm: Communicator, tensor: torch.Tensor, src: int) -> None:
    """Binomial-tree broadcast: afterwards every rank's ``tensor`` equals rank ``src``'s.

    In place, any shape and dtype. Number the ranks relative to the source,
    ``vrank = (rank - src) % p``, so that the source is ``vrank`` 0. In round ``k`` every rank
    that already has the data (``vrank < 2**k``) sends it ``2**k`` ranks further on; the number
    of ranks holding the data doubles each round. For p = 8::

        round 0:   0 --> 1
        round 1:   0 --> 2    1 --> 3
        round 2:   0 --> 4    1 --> 5    2 --> 6    3 --> 7

    (with p = 6 the arrows to 6 and 7 are simply left out.)

    Cost: ``ceil(log2 p)`` rounds of one ``n``-byte message, ``ceil(log2 p) * (alpha + n beta)``,
    instead of ``(p - 1) * (alpha + n beta)`` when the source sends to everyone itself. The
    source sends ``ceil(log2 p)`` messages, every other rank receives exactly one.
    """
    # TODO(task 1): binomial-tree broadcast. Hints:
    # - compute vrank = (comm.rank - src) % p; a vrank v is the real rank (v + src) % p.
    # - for distance = 1, 2, 4, ... while distance < p:
    #     vrank < distance                 -> you have the data: send to vrank + distance (if < p)
    #     distance <= vrank < 2 * distance -> receive from vrank - distance
    # - send and recv work on `tensor` directly, whatever its shape: nothing to copy.
    raise NotImplementedError("TODO(task 1): write tree_broadcast (see the hints above it)")


# --- task 2 ------------------------------------------------------------------------------
def ring_allgather(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    """Ring allgather: return ``out`` of shape ``(p, *tensor.shape)`` with ``out[r]`` = rank r's tensor.

    Every rank sends only to its right neighbour ``(rank + 1) % p`` and receives only from its
    left neighbour ``(rank - 1) % p``::

            +--> 0 --> 1 --+
            |              |          p = 4
            +--- 3 <-- 2 <-+

    Rank ``r`` first copies its own tensor into ``out[r]``. In each of ``p - 1`` steps it
    passes on the block it received last (its own, in step 0) and receives a new one from the
    left. Which block rank ``r`` sends in step ``s``: ``(r - s) % p``::

                   rank 0   rank 1   rank 2   rank 3
          step 0      0        1        2        3
          step 1      3        0        1        2
          step 2      2        3        0        1

    Cost: ``p - 1`` steps; every rank sends and receives ``(p - 1) * n`` bytes in ``p - 1``
    messages: ``(p - 1) * (alpha + n beta)``. No rank is a bottleneck: all links are busy at
    once. The input is not modified.
    """
    # TODO(task 2): ring allgather. Hints:
    # - out = torch.empty((p, *tensor.shape), dtype=tensor.dtype); out[rank] = your tensor
    #   (out[i] is a contiguous view of one row of `out`: you can send it and receive into it).
    # - step s = 0 .. p-2: send out[(rank - s) % p] to the right, receive out[(rank - s - 1) % p]
    #   from the left, both at once with exchange(...).
    raise NotImplementedError("TODO(task 2): write ring_allgather (see the hints above it)")


# --- task 3 ------------------------------------------------------------------------------
def ring_reduce_scatter(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter: rank r returns block r of the sum of all ranks' tensors.

    Split dim 0 of ``tensor`` into ``p`` equal blocks, ``block i = tensor[i*m : (i+1)*m]`` with
    ``m = tensor.shape[0] // p``. Rank ``r`` returns ``sum over ranks q of block r of q's
    tensor``, a new tensor of shape ``(m, *tensor.shape[1:])``. A first dimension that is not
    a multiple of ``p`` (or a 0-dim tensor) is a ``ValueError``, raised before any message.

    The same ring as allgather, but what travels is a *partial sum* that grows by one rank's
    contribution at every hop. In step ``s`` rank ``r`` sends its partial sum of block
    ``(r - s - 1) % p`` to the right, receives the partial sum of block ``(r - s - 2) % p``
    from the left and adds its own contribution to it. The block rank ``r`` sends::

                   rank 0   rank 1   rank 2   rank 3
          step 0      3        0        1        2
          step 1      2        3        0        1
          step 2      1        2        3        0

    After step ``p - 2`` rank ``r`` has received block ``r`` with the contributions of all
    the other ranks, added its own, and is done.

    Cost: ``p - 1`` steps; every rank sends ``(p - 1) / p * n`` bytes (``n`` = size of the
    input) in ``p - 1`` messages. The input is not modified.
    """
    # TODO(task 3): ring reduce-scatter. Hints:
    # - check the shape first: raise ValueError (with a helpful message) before any message.
    # - blocks = tensor.reshape(p, tensor.numel() // p).clone(): row i is block i, flattened,
    #   and a private copy you may add into.
    # - receive into a scratch row (torch.empty_like(blocks[0])), then add it to the block.
    # - return block `rank`, reshaped to (m, *tensor.shape[1:]).
    raise NotImplementedError("TODO(task 3): write ring_reduce_scatter (see the hints above it)")


# --- task 4 ------------------------------------------------------------------------------
def ring_allreduce(comm: Communicator, tensor: torch.Tensor) -> None:
    """Ring allreduce: afterwards every rank's ``tensor`` holds the sum of all ranks' tensors.

    In place, any shape, any number of elements (0 and fewer than ``p`` included), contiguous
    or not. Two phases over ``p`` chunks of the flattened tensor (``chunk_offsets``; chunk
    sizes differ by at most one element):

    1. **reduce-scatter** (task 3's ring): after ``p - 1`` steps rank ``r`` holds the full sum
       of chunk ``r``;
    2. **allgather** (task 2's ring): ``p - 1`` more steps pass the finished chunks around.

    ::

        p = 3, chunks A B C        start          after reduce-scatter     after allgather
                     rank 0:    A0  B0  C0          A   .   .              A   B   C
                     rank 1:    A1  B1  C1          .   B   .              A   B   C
                     rank 2:    A2  B2  C2          .   .   C              A   B   C

        where A = A0 + A1 + A2 (and so on), and "." is a partial sum nobody needs any more.

    Cost: ``2 (p - 1)`` steps, each moving one chunk of ``n / p`` bytes per rank: every rank
    sends ``2 (p - 1) / p * n`` bytes, *less than 2n whatever p is* -- the reason the ring is
    the workhorse of data-parallel training. Time ``2 (p - 1) (alpha + n / p * beta)``.
    """
    # TODO(task 4): ring allreduce. Hints:
    # - p == 1: nothing to do.
    # - work on a contiguous flat copy (`tensor` may be non-contiguous), and copy back at the end:
    #       flat = tensor.reshape(-1).clone(memory_format=torch.contiguous_format)
    #       tensor.copy_(flat.view(tensor.shape))
    # - offsets = chunk_offsets(flat.numel(), p); chunk i is flat[offsets[i]:offsets[i + 1]].
    # - reduce-scatter: step s sends chunk (rank - s - 1) % p right, receives chunk
    #   (rank - s - 2) % p from the left into a scratch buffer of the right size, adds it.
    # - allgather: step s sends chunk (rank - s) % p, receives chunk (rank - s - 1) % p
    #   straight into flat.
    raise NotImplementedError("TODO(task 4): write ring_allreduce (see the hints above it)")


# --- task 5 ------------------------------------------------------------------------------
def butterfly_allreduce(comm: Communicator, tensor: torch.Tensor) -> None:
    """Butterfly allreduce (Rabenseifner): the sum, in place, in ``2 log2 p`` steps.

    Same contract as ``ring_allreduce``. For ``p`` a power of two, over ``p`` chunks of the
    flattened tensor (``chunk_offsets``):

    1. **reduce-scatter by recursive halving.** With distance ``d = p/2, p/4, ..., 1``, rank
       ``r`` pairs with ``r XOR d``. Both hold the same range of chunks; the one whose bit
       ``d`` is 0 keeps the lower half, the other the upper half. Each sends the half it gives
       up and adds the half it receives. Ranges halve each step; at the end rank ``r`` holds
       the full sum of chunk ``r``.
    2. **allgather by recursive doubling.** The same pairs in reverse order (``d = 1, 2, ...,
       p/2``): each rank sends the range it has and receives its partner's, the neighbouring
       range of the same size. Ranges double each step.

    ::

        p = 4, chunks A B C D         rank 0    rank 1    rank 2    rank 3
        start                         A B C D   A B C D   A B C D   A B C D
        halving,  d = 2 (0-2, 1-3)    A B       A B           C D       C D
        halving,  d = 1 (0-1, 2-3)    A           B           C           D   <- complete sums
        doubling, d = 1 (0-1, 2-3)    A B       A B           C D       C D
        doubling, d = 2 (0-2, 1-3)    A B C D   A B C D   A B C D   A B C D

    Cost: ``2 log2 p`` steps; every rank sends ``n/2 + n/4 + ... = (p - 1) / p * n`` bytes in
    each phase, ``2 (p - 1) / p * n`` in all, like the ring -- but in ``2 log2 p`` messages
    instead of ``2 (p - 1)``: far fewer latencies when ``p`` is large or ``n`` small.

    **p not a power of two.** Let ``p2`` be the largest power of two below or equal to ``p``
    and ``rem = p - p2``. The first ``2 rem`` ranks pair up: each even one sends its whole
    vector to the odd one after it and sits out; the odd one adds it. The ``p2`` remaining
    ranks run the butterfly under *virtual* ranks ``0 .. p2-1``; then each odd rank of the
    first ``2 rem`` sends the result back to its even partner. For p = 6 (``p2`` = 4, ``rem`` = 2)::

        fold in:    0 --> 1    2 --> 3          (ranks 0 and 2 wait)
        butterfly:  real ranks 1 3 4 5 as virtual ranks 0 1 2 3
        fold out:   1 --> 0    3 --> 2

    The folding costs one extra ``n``-byte message before and after.
    """
    # TODO(task 5): butterfly allreduce. Hints:
    # - flat copy and copy back as in task 4; p == 1: nothing to do.
    # - p2 = 1 << (p.bit_length() - 1); rem = p - p2.
    # - fold in: rank < 2 * rem and even: send all of flat to rank + 1 (you have no vrank);
    #   rank < 2 * rem and odd: receive from rank - 1, add; vrank = rank // 2;
    #   rank >= 2 * rem: vrank = rank - rem. Virtual rank v is real rank
    #   2 * v + 1 if v < rem else v + rem.
    # - keep the range of chunks you are responsible for as (lo, hi); it starts as (0, p2).
    #   Its elements are flat[offsets[lo]:offsets[hi]], offsets = chunk_offsets(flat.numel(), p2).
    # - fold out at the end: the odd ranks of the first 2 * rem send the result to rank - 1.
    raise NotImplementedError("TODO(task 5): write butterfly_allreduce (see the hints above it)")
