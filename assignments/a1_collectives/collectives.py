"""Assignment 1: collectives built from point-to-point messages.

You write six collective operations with nothing but the four point-to-point calls of a
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
6      ``fast_allreduce``        the same sum, as fast as you can make it at every size
=====  ========================  =====================================================

Notation in the docstrings: ``p`` is ``comm.world_size``, ``n`` the size of a rank's tensor
in bytes, ``alpha`` the latency of one message and ``beta`` the time per byte, so a message
of ``m`` bytes costs ``alpha + m * beta``.

The tests do not only check the values: they read ``comm.stats`` around each call and check
that every rank sends exactly the bytes and messages the algorithm of the docstring sends. A
ring allreduce that gathers everything on rank 0 and broadcasts the sum is correct, and still
fails. Calling the library's collectives (``md.allreduce`` and friends) or torch's scores 0.
Task 6 is measured: its points come in tiers, by how fast its messages are on an emulated link.

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
    "fast_allreduce",
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

    In place, any shape and dtype, any ``src``. The tree, exactly (the hidden tests check each
    rank's messages against it): number the ranks from the source, ``vrank = (rank - src) % p``;
    in round ``k = 0, 1, ...`` every rank that already holds the data sends it to the rank
    ``2**k`` further on, if there is one. The ranks holding the data double every round.

    Cost: ``ceil(log2 p)`` rounds, ``ceil(log2 p) * (alpha + n beta)``, against
    ``(p - 1) * (alpha + n beta)`` when the source sends to everyone itself. The source sends
    ``ceil(log2 p)`` messages, every other rank receives exactly one. Read: lecture 2, section 2
    (the tree).
    """
    # TODO(task 1): binomial-tree broadcast (see the docstring). Questions first:
    # - in round k, which vranks hold the data, and which receive it?
    # - does send/recv need a copy of a non-contiguous `tensor`, or can it use it as it is?
    raise NotImplementedError("TODO(task 1): write tree_broadcast (see the docstring)")


# --- task 2 ------------------------------------------------------------------------------
def ring_allgather(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    """Ring allgather: return ``out`` of shape ``(p, *tensor.shape)`` with ``out[r]`` = rank r's tensor.

    Every rank sends only to its right neighbour ``(rank + 1) % p`` and receives only from its
    left neighbour ``(rank - 1) % p``, one whole input per message, in ``p - 1`` steps: at each
    step it passes on an input it holds and has not passed on yet. The input is not modified.

    Cost: ``p - 1`` steps; every rank sends and receives ``(p - 1) * n`` bytes in ``p - 1``
    messages: ``(p - 1) * (alpha + n beta)``. No rank is a bottleneck: all links are busy at
    once. Read: lecture 2, section 2 (the ring) and section 6 (allgather).
    """
    # TODO(task 2): ring allgather (see the docstring). Questions first:
    # - which input does rank r pass on at step s, so that nobody waits for what it has not got?
    # - why must every rank send and receive at the same time (``exchange``'s docstring)?
    raise NotImplementedError("TODO(task 2): write ring_allgather (see the docstring)")


# --- task 3 ------------------------------------------------------------------------------
def ring_reduce_scatter(comm: Communicator, tensor: torch.Tensor) -> torch.Tensor:
    """Ring reduce-scatter: rank r returns block r of the sum of all ranks' tensors.

    Split dim 0 of ``tensor`` into ``p`` equal blocks, ``block i = tensor[i*m : (i+1)*m]`` with
    ``m = tensor.shape[0] // p``. Rank ``r`` returns ``sum over ranks q of block r of q's
    tensor``, a new tensor of shape ``(m, *tensor.shape[1:])``. A first dimension that is not
    a multiple of ``p`` (or a 0-dim tensor) is a ``ValueError``, raised before any message.
    The input is not modified.

    The same ring as allgather, but what travels is a *partial sum*: at step ``k`` a rank sends
    to its right neighbour one block summed over the ``k + 1`` ranks behind it (itself
    included), so that after ``p - 1`` steps each rank holds its own block complete.

    Cost: ``p - 1`` steps; every rank sends ``(p - 1) / p * n`` bytes (``n`` = size of the
    input) in ``p - 1`` messages. Read: lecture 2, section 3 ("Write the ring yourself").
    """
    # TODO(task 3): ring reduce-scatter (see the docstring). Questions first:
    # - which block must rank r send first, so that the block that ends on rank r is the one
    #   it receives last?
    # - where does the partial sum you receive go, so that your input stays as it was?
    raise NotImplementedError("TODO(task 3): write ring_reduce_scatter (see the docstring)")


# --- task 4 ------------------------------------------------------------------------------
def ring_allreduce(comm: Communicator, tensor: torch.Tensor) -> None:
    """Ring allreduce: afterwards every rank's ``tensor`` holds the sum of all ranks' tensors.

    In place, any shape, any number of elements (0 and fewer than ``p`` included), contiguous
    or not. Two phases over ``p`` chunks of the flattened tensor cut by ``chunk_offsets``: a
    reduce-scatter (task 3's ring), after which rank ``r`` holds the complete sum of chunk ``r``,
    then an allgather (task 2's ring) of the complete chunks. Every message goes to the right
    neighbour.

    Cost: ``2 (p - 1)`` steps, each moving one chunk of ``n / p`` bytes per rank: every rank
    sends ``2 (p - 1) / p * n`` bytes, *less than 2n whatever p is* -- the reason the ring is
    the workhorse of data-parallel training. Time ``2 (p - 1) (alpha + n / p * beta)``.
    Read: lecture 2, sections 2 and 3.
    """
    # TODO(task 4): ring allreduce (see the docstring). Questions first:
    # - what must change from tasks 2 and 3 when the chunks differ in size, or some are empty?
    # - a non-contiguous `tensor` cannot be sent in pieces: what do you work on instead?
    raise NotImplementedError("TODO(task 4): write ring_allreduce (see the docstring)")


# --- task 5 ------------------------------------------------------------------------------
def butterfly_allreduce(comm: Communicator, tensor: torch.Tensor) -> None:
    """Butterfly allreduce (Rabenseifner): the sum, in place, in ``2 log2 p`` steps.

    Same contract as ``ring_allreduce``. For ``p`` a power of two, over ``p`` chunks of the
    flattened tensor (``chunk_offsets``): a reduce-scatter by **recursive halving** -- at
    distance ``d = p/2, p/4, ..., 1`` rank ``r`` pairs with ``r XOR d``; of the range of chunks
    both hold, the rank whose bit ``d`` is 0 keeps the lower half, the other the upper half;
    each sends the half it gives up and adds the half it receives -- so that rank ``r`` ends
    with the complete sum of chunk ``r``; then an allgather by **recursive doubling**, the same
    pairs in reverse order (``d = 1, 2, ..., p/2``), each sending the range it has.

    **p not a power of two.** With ``p2`` the largest power of two ``<= p`` and
    ``rem = p - p2``, the first ``2 rem`` ranks fold in pairs before the butterfly: each even
    one sends its whole vector to the odd one after it and sits out; the ``p2`` ranks left run
    the butterfly (the odd folded ranks first, in order, then the ranks from ``2 rem`` on);
    afterwards each odd rank sends the result back to its even partner.

    Cost: ``2 log2 p`` steps; every rank sends ``(p - 1) / p * n`` bytes in each phase,
    ``2 (p - 1) / p * n`` in all, like the ring -- in ``2 log2 p`` messages instead of
    ``2 (p - 1)``. Folding costs one extra ``n``-byte message before and after. Read: lecture 2,
    section 2 (the butterfly, and "When p is not a power of two"); Thakur, Rabenseifner and Gropp
    (2005), "Optimization of collective communication operations in MPICH", section 4.
    """
    # TODO(task 5): butterfly allreduce (see the docstring). Questions first:
    # - which ranks' data does a rank hold, for which chunks, after each halving step?
    # - after the fold, how does a rank that takes part find its partner's real rank?
    raise NotImplementedError("TODO(task 5): write butterfly_allreduce (see the docstring)")


# --- task 6 ------------------------------------------------------------------------------
#: the link the grader times task 6 on: 10 Gbit/s Ethernet (``transport.emulated.ETHERNET_10G``)
LINK_ALPHA = 15e-6  # seconds per message
LINK_BANDWIDTH = 1.25e9  # bytes per second


def fast_allreduce(comm: Communicator, tensor: torch.Tensor) -> None:
    """An allreduce that is fast at every size: the sum, in place, same contract as ``ring_allreduce``.

    Measured, not prescribed. The grader times the messages your ranks send on an emulated
    link (``LINK_ALPHA`` per message, ``LINK_BANDWIDTH`` bytes per second; each rank has one
    outgoing link whose messages leave one after another, receiving is free: lecture 2,
    section 4, and ``minidist.transport.emulated``), for float32 tensors from 256 bytes to
    1 MiB on 4 and 5 ranks. At each size it compares your time with the best of three textbook
    allreduces under the same model -- the ring, the butterfly and recursive doubling of the
    whole vector (each round, partners exchange everything they have and add it:
    ``log2 p`` rounds of ``alpha + n beta``; ranks beyond a power of two folded in and out as
    in task 5) -- and keeps your worst ratio on each number of ranks. Full points at 1.1x or
    less, half at 1.4x, a quarter at 2.5x; the library's ``md.allreduce(algorithm="auto")``
    reaches 1.98x on 4 ranks and 1.59x on 5.

    The values are checked as in tasks 4 and 5 (every message must carry real sums), and every
    rank must take the same decisions: they all see the same ``p`` and size. Which algorithm
    wins where, and why? Lecture 2, section 4 (the cost model and its crossovers), and
    Thakur, Rabenseifner and Gropp (2005), "Optimization of collective communication
    operations in MPICH", section 4.
    """
    # TODO(task 6): an allreduce that is fast at every size (see the docstring).
    raise NotImplementedError("TODO(task 6): write fast_allreduce")
