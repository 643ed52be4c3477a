"""Workers for lecture 01, section 6: run an allreduce written from send and recv, count its messages."""

import torch

import minidist as md
from minidist.collectives import api, butterfly, ring, rooted, shm_allreduce

# Every ready-made collective a rank could call instead of writing its own. md.switched_off
# replaces each one wherever a loaded module binds it (minidist, minidist.collectives, their
# modules, or a name your module imported itself), so that calling it raises an AssertionError.
LIBRARY_COLLECTIVES = [
    *(md.allreduce, md.allgather, md.reduce_scatter, md.broadcast, md.reduce, md.barrier),
    api.run_collective,  # what each of those calls
    *(ring.ring_reduce_scatter_, ring.ring_allgather_, butterfly.butterfly_allreduce_),
    *(rooted.star_broadcast, rooted.star_reduce, rooted.tree_broadcast, rooted.tree_reduce),
    shm_allreduce.shm_allreduce,
]


def make_input(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s tensor: random numbers, the same in every run (the notebook recomputes them)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def run_allreduce(comm, allreduce, numel, exercise):
    """Call `allreduce(comm, x)` on this rank's tensor, with minidist's collectives switched off;
    return (x afterwards, the traffic it caused)."""
    x = make_input(comm.rank, numel)
    before = comm.stats  # a snapshot of this rank's message counters
    with md.switched_off(exercise, *LIBRARY_COLLECTIVES):  # they raise while `allreduce` runs
        allreduce(comm, x)
    return x, comm.stats - before
