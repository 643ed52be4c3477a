"""Lecture 02, Try it 1: the reduce-scatter half of the ring, from isend and recv."""

import torch

import minidist as md


def ring_reduce_scatter_(comm: md.Communicator, flat: torch.Tensor) -> None:
    """In place on `flat` (1-D, length a multiple of p): afterwards chunk `rank` of `flat` holds
    that chunk summed over all ranks (the other chunks hold partial sums: scratch).

    The chunks are the rows of flat.view(p, -1). In step s = 0 .. p-2, rank r sends chunk
    (r - s - 1) % p to its right neighbour (r + 1) % p, receives chunk (r - s - 2) % p from its
    left neighbour (r - 1) % p and adds it to its own copy of that chunk.
    Cost: p - 1 messages of n / p bytes, (p - 1) / p * n bytes sent per rank.
    """
    raise NotImplementedError("TODO(Try it 1): p - 1 steps of isend a chunk right, recv from the left, add")
