"""Workers for lecture 01, section 5: a parallel sum."""

import time

import torch


def partial_sum(comm, x, work):
    """Reduce this rank's contiguous block of `x`; return (partial result, start, end, cpu).

    work="sum":  plain sum, one addition per 4 bytes read (memory-bound);
    work="sin2": sum of sin(x)**2, dozens of flops per element (compute-bound).
    start and end come from time.monotonic(), one clock for all processes of a machine; cpu is
    the time this worker actually ran on a core in between (time.thread_time()), less than
    end - start when another program had its core.
    """
    n, p, r = x.numel(), comm.world_size, comm.rank
    block = x[n * r // p : n * (r + 1) // p]
    block.sum()  # untimed warm-up: the first touch of each page of shared memory is slow
    comm.barrier()  # start together
    start, cpu = time.monotonic(), time.thread_time()
    if work == "sum":
        total = block.sum()
    else:
        total = torch.zeros(())
        for chunk in block.split(1 << 16):  # 256 KiB pieces stay in the CPU cache
            total += torch.sin(chunk).square_().sum()
    return total, start, time.monotonic(), time.thread_time() - cpu
