"""Workers for lecture 01, section 6: run an allreduce written from send and recv, count its messages."""

import contextlib
from unittest import mock

import torch

import minidist as md
from minidist import collectives
from minidist.collectives import api, butterfly, ring, rooted, shm_allreduce

# Everywhere a rank could find a ready-made collective: the package, minidist.collectives, its modules.
PUBLIC = ["allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "barrier"]
ALGORITHMS = {
    ring: ["ring_reduce_scatter_", "ring_allgather_"],
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


def make_input(rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s tensor: random numbers, the same in every run (the notebook recomputes them)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank))


def run_allreduce(comm, allreduce, numel, exercise):
    """Call `allreduce(comm, x)` on this rank's tensor, with minidist's collectives switched off;
    return (x afterwards, the traffic it caused)."""
    x = make_input(comm.rank, numel)
    before = comm.stats  # a snapshot of this rank's message counters
    with collectives_switched_off(exercise):  # md.allreduce & co. raise while `allreduce` runs
        allreduce(comm, x)
    return x, comm.stats - before
