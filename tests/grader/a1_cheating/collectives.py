"""A wrong submission for assignment 1: a "ring" allreduce that is no ring at all.

Every rank sends its whole tensor to rank 0, which adds them up and sends the sum back to
everyone. The values are right; the traffic is not: rank 0 sends (p - 1) * n bytes where a
ring sends 2 (p - 1) / p * n. tests/course/test_assignments.py checks that the hidden correctness
tests pass with it and the byte-budget tests fail. The other functions are not implemented.
"""

from __future__ import annotations

import torch


def ring_allreduce(comm, tensor: torch.Tensor) -> None:
    if comm.rank != 0:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)
        return
    incoming = torch.empty_like(tensor)
    for src in range(1, comm.world_size):
        comm.recv(incoming, src)
        tensor += incoming
    for dst in range(1, comm.world_size):
        comm.send(tensor, dst)


def _not_part_of_this_cheat(*args, **kwargs):
    raise NotImplementedError("not part of this cheat")


tree_broadcast = ring_allgather = ring_reduce_scatter = butterfly_allreduce = _not_part_of_this_cheat
