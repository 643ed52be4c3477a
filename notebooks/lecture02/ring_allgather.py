"""Lecture 02, Try it 2: the allgather half of the ring; with Try it 1, the whole ring allreduce."""

import torch

import minidist as md
from lecture02 import ring


def ring_allgather_(comm: md.Communicator, flat: torch.Tensor) -> None:
    """In place on `flat` (1-D, length a multiple of p): rank r starts with chunk r complete and
    ends with every chunk complete (whatever its other chunks held before).

    In step s = 0 .. p-2, rank r sends chunk (r - s) % p to its right neighbour and receives
    chunk (r - s - 1) % p from its left one, straight into place.
    Cost: p - 1 messages of n / p bytes, (p - 1) / p * n bytes sent per rank.
    """
    raise NotImplementedError(
        "TODO(Try it 2): p - 1 steps of isend a chunk right, recv the next one into place"
    )


def ring_allreduce_(comm: md.Communicator, flat: torch.Tensor) -> None:
    """The ring allreduce, in place: the reduce-scatter of Try it 1, then the allgather above.
    2 (p - 1) messages of n / p bytes: 2 (p - 1) / p * n bytes sent per rank."""
    ring.ring_reduce_scatter_(comm, flat)
    ring_allgather_(comm, flat)
