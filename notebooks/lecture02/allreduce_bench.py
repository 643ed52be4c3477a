"""Workers for lecture 02, sections 3 and 4: the bytes each allreduce sends, and its time."""

import time

import torch

import minidist as md
from minidist.collectives import api, butterfly, rooted, shm_allreduce
from minidist.collectives import ring as library_ring  # not lecture02.ring, the one you write
from minidist.transport.emulated import EmulatedLinkComm


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


# Every ready-made collective a rank could call instead of writing its own. md.switched_off
# replaces each one wherever a loaded module binds it (minidist, minidist.collectives, their
# modules, or a name your module imported itself), so that calling it raises an AssertionError.
LIBRARY_COLLECTIVES = [
    *(md.allreduce, md.allgather, md.reduce_scatter, md.broadcast, md.reduce, md.barrier),
    api.run_collective,  # what each of those calls
    *(library_ring.ring_reduce_scatter_, library_ring.ring_allgather_, butterfly.butterfly_allreduce_),
    *(rooted.star_broadcast, rooted.star_reduce, rooted.tree_broadcast, rooted.tree_reduce),
    shm_allreduce.shm_allreduce,
]


def ring_input(rank, numel):
    """Rank `rank`'s vector for the ring exercises: whole numbers, so that every order of addition
    gives exactly the same sum (float32 holds whole numbers up to 2**24 exactly)."""
    generator = torch.Generator().manual_seed(2000 + rank)
    return torch.randint(-1000, 1000, (numel,), generator=generator).float()


def run_ring(comm, ring_step, numel, exercise, start="input"):
    """Run `ring_step(comm, flat)` (a half of the ring, or both) on this rank's ring_input, with
    minidist's collectives switched off while it runs (`exercise` names the Try it in the error).

    start="input": `flat` is the rank's vector (for a reduce-scatter or a whole allreduce);
    start="own chunk": chunk `rank` of `flat` already holds the sum, every other element is NaN
    (for an allgather alone). Returns `flat` afterwards, the traffic `ring_step` caused, and what
    minidist's reduce_scatter and allreduce give for the same vector (computed before).
    """
    p, rank = comm.world_size, comm.rank
    flat = ring_input(rank, numel)
    library = {"reduce_scatter": md.reduce_scatter(comm, flat), "allreduce": md.allreduce(comm, flat.clone())}
    if start == "own chunk":
        flat = torch.full_like(flat, float("nan"))
        flat.view(p, -1)[rank] = library["reduce_scatter"]
    before = comm.stats
    with md.switched_off(exercise, *LIBRARY_COLLECTIVES):  # they raise while `ring_step` runs
        ring_step(comm, flat)
    return flat, comm.stats - before, library


def time_emulated(comm, algorithm, nbytes, link, repeats):
    """Seconds of each of `repeats` allreduces of `nbytes`, every rank sending over its own
    emulated link (alpha_s, bandwidth_Bps); one untimed allreduce first."""
    slow = EmulatedLinkComm(comm, *link)
    x = torch.zeros(nbytes // 4)
    md.allreduce(slow, x, algorithm=algorithm)
    seconds = []
    for _ in range(repeats):
        comm.barrier()  # start together
        start = time.perf_counter()
        md.allreduce(slow, x, algorithm=algorithm)
        seconds.append(time.perf_counter() - start)
    slow.close()
    return seconds
