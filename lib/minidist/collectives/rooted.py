"""Broadcast and reduce: one root, two shapes of communication.

**star** -- the root talks to everyone directly::

    broadcast:  root -> 1, root -> 2, ..., root -> p-1      (p-1 sends, all by the root)
    reduce:     1 -> root, 2 -> root, ..., p-1 -> root      (p-1 receives, all at the root)

  Simple, but the root's link carries (p-1) n bytes: time ~ (p-1)(alpha + n beta).

**tree** -- a binomial tree: in round k every rank that already has the data
sends it 2^k ranks further, so the number of ranks holding it doubles::

    p = 8, root 0     round 0: 0->1
                      round 1: 0->2, 1->3
                      round 2: 0->4, 1->5, 2->6, 3->7

  ceil(log2 p) rounds: time ~ log2(p) (alpha + n beta), and no rank sends more
  than log2(p) n bytes. Reduce runs the same tree backwards, combining as it goes.

Ranks are renumbered relative to the root (vrank = (rank - root) mod p), so any
rank can be the root.
"""

from __future__ import annotations

import torch

from ..comm import Communicator
from .ops import combine_


def star_broadcast(comm: Communicator, flat: torch.Tensor, root: int, tag: int = 0) -> None:
    if comm.rank == root:
        works = [comm.isend(flat, peer, tag) for peer in range(comm.world_size) if peer != root]
        for work in works:
            work.wait()
    else:
        comm.recv(flat, root, tag)


def tree_broadcast(comm: Communicator, flat: torch.Tensor, root: int, tag: int = 0) -> None:
    p = comm.world_size
    vrank = (comm.rank - root) % p
    mask = 1
    while mask < p:  # find my parent: the rank that differs in my lowest set bit
        if vrank & mask:
            comm.recv(flat, (vrank - mask + root) % p, tag)
            break
        mask <<= 1
    mask >>= 1
    works = []
    while mask > 0:  # pass it on to my children, the farthest first
        if vrank + mask < p:
            works.append(comm.isend(flat, (vrank + mask + root) % p, tag))
        mask >>= 1
    for work in works:
        work.wait()


def star_reduce(comm: Communicator, flat: torch.Tensor, root: int, op: str, tag: int = 0) -> torch.Tensor:
    """Returns the reduced vector on the root (``flat`` itself); others' ``flat`` is untouched."""
    if comm.rank != root:
        comm.send(flat, root, tag)
        return flat
    incoming = torch.empty_like(flat)
    for peer in range(comm.world_size):  # in rank order: every run combines in the same order
        if peer != root:
            comm.recv(incoming, peer, tag)
            combine_(flat, incoming, op)
    return flat


def tree_reduce(comm: Communicator, flat: torch.Tensor, root: int, op: str, tag: int = 0) -> torch.Tensor:
    """Binomial-tree reduce; returns the result on the root. Non-roots send a partial sum."""
    p = comm.world_size
    vrank = (comm.rank - root) % p
    acc = flat if comm.rank == root else flat.clone()  # non-roots keep their input intact
    incoming = None
    mask = 1
    while mask < p:
        if vrank & mask:
            comm.send(acc, (vrank - mask + root) % p, tag)
            break
        if vrank + mask < p:
            if incoming is None:
                incoming = torch.empty_like(flat)
            comm.recv(incoming, (vrank + mask + root) % p, tag)
            combine_(acc, incoming, op)
        mask <<= 1
    return acc
