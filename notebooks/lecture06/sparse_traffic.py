"""Lecture 06, section 3: bytes a rank sends for one bucket, DGC allgather vs dense ring, N = 2..world."""

import torch

import minidist as md
from minidist.parallel.compression import DeepGradientCompression, DGCConfig
from minidist.parallel.group import SubComm


def bytes_per_rank(comm, numel, sparsity):
    """{N: (DGC bytes, dense ring bytes)} sent by this rank, for groups of the first N ranks."""
    out = {}
    for n in range(2, comm.world_size + 1):
        comm.barrier()
        if comm.rank >= n:
            continue
        group = SubComm(comm, range(n))  # no shared workspace: every byte is a message
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
        before = comm.stats
        DeepGradientCompression(DGCConfig(sparsity=sparsity))(group, grad.clone(), 0).wait()
        middle = comm.stats
        md.allreduce(group, grad.clone(), op="sum", algorithm="ring")
        after = comm.stats
        out[n] = ((middle - before).bytes_sent, (after - middle).bytes_sent)
    comm.barrier()
    return out
