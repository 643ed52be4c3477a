"""Workers for lecture 01, section 6: run an allreduce written from send and recv, count its messages."""

import torch


def make_input(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s tensor: random numbers, the same in every run (the notebook recomputes them)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def run_allreduce(comm, allreduce, numel):
    """Call `allreduce(comm, x)` on this rank's tensor; return (x afterwards, the traffic it caused)."""
    x = make_input(comm.rank, numel)
    before = comm.stats  # a snapshot of this rank's message counters
    allreduce(comm, x)
    return x, comm.stats - before
