"""Workers for lecture 02, sections 3 and 4: the bytes each allreduce sends, and its time."""

import contextlib
import time
from unittest import mock

import torch

import minidist as md
from minidist import collectives
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


# Everywhere a rank could find a ready-made collective: the package, minidist.collectives, its modules.
PUBLIC = ["allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "barrier"]
ALGORITHMS = {
    library_ring: ["ring_reduce_scatter_", "ring_allgather_"],
    rooted: ["star_broadcast", "star_reduce", "tree_broadcast", "tree_reduce"],
    butterfly: ["butterfly_allreduce_"],
    shm_allreduce: ["shm_allreduce"],
}
SWITCHED_OFF = [(module, name) for module in (md, collectives, api) for name in PUBLIC]
SWITCHED_OFF += [(api, "run_collective")]  # runs every public one: catches a name imported before
SWITCHED_OFF += [  # each algorithm under its own module's name and under api's, which imported it
    (home, name) for module, names in ALGORITHMS.items() for name in names for home in (module, api)
]


@contextlib.contextmanager
def collectives_switched_off(exercise: str):
    """Within the block, calling one of minidist's collectives raises an AssertionError."""

    def refuse(name):
        def switched_off(*args, **kwargs):
            raise AssertionError(
                f"{exercise} asks for send/recv only; the library's collectives are switched off "
                f"while your function runs (it called {name})"
            )

        return switched_off

    with contextlib.ExitStack() as stack:
        for module, name in SWITCHED_OFF:
            stack.enter_context(mock.patch.object(module, name, refuse(f"{module.__name__}.{name}")))
        yield


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
    with collectives_switched_off(exercise):  # md.reduce_scatter & co. raise while `ring_step` runs
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
