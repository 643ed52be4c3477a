"""Workers for lecture 02, sections 3 and 4: the bytes each allreduce sends, and its time."""

import time

import torch

import minidist as md


def bytes_sent(comm, algorithms, numel):
    """Allreduce `numel` float32 once per algorithm; return {algorithm: bytes this rank sent}."""
    p = comm.world_size
    sent = {}
    for algorithm in algorithms:
        x = torch.full((numel,), float(comm.rank + 1))
        before = comm.stats  # a snapshot of the counters
        md.allreduce(comm, x, algorithm=algorithm)
        sent[algorithm] = (comm.stats - before).bytes_sent
        assert torch.all(x == p * (p + 1) / 2), f"{algorithm}: wrong sum on rank {comm.rank}"
    return sent


def time_allreduce(comm, algorithms, nbytes, iterations, repeats):
    """Seconds per allreduce of `nbytes` for each algorithm (best of `repeats` timings
    of `iterations` calls; the algorithms take turns, so a busy moment hits them all)."""
    x = torch.zeros(nbytes // 4)  # zeros stay zeros: the sums never overflow
    best = {algorithm: float("inf") for algorithm in algorithms}
    for algorithm in algorithms:  # warm-up: buffers, threads, caches
        md.allreduce(comm, x, algorithm=algorithm)
    for _ in range(repeats):
        for algorithm in algorithms:
            comm.barrier()  # start together
            start = time.perf_counter()
            for _ in range(iterations):
                md.allreduce(comm, x, algorithm=algorithm)
            best[algorithm] = min(best[algorithm], (time.perf_counter() - start) / iterations)
    return best
