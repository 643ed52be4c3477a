"""Lecture 10, Try it 1: the all-to-all from point-to-point messages, and the rank body that checks it."""

import importlib

import torch

import minidist as md

# Every library route to the all-to-all: md.all_to_all (minidist.collectives.api.all_to_all, which
# the experts and Ulysses call) and the functions of the module that does the work. md.switched_off
# makes each one raise wherever a loaded module binds it while your function runs.
_a2a = importlib.import_module("minidist.collectives.all_to_all")  # the module, not md.all_to_all
LIBRARY_ALL_TO_ALL = [
    md.all_to_all,
    *(_a2a.pairwise_exchange, _a2a.all_to_all_equal, _a2a.all_to_all_split, _a2a.exchange_counts),
]


def my_all_to_all(comm: md.Communicator, t: torch.Tensor) -> torch.Tensor:
    """Row j of ``t`` (shape (p, *chunk)) goes to rank j; row i of the result came from rank i.

    Pairwise exchange: in step s = 1 .. p-1 this rank sends its row for rank (rank + s) mod p
    and receives the row of rank (rank - s) mod p; its own row it copies. Post the send with
    ``comm.isend(tensor, dst)`` (it returns a handle: ``.wait()`` on it) before the blocking
    ``comm.recv(buffer, src)``, so that every rank's receive has its matching send in flight.
    Cost: p-1 messages, (p-1)/p of ``t``'s bytes sent.
    """
    raise NotImplementedError("TODO(Try it 1): the pairwise exchange, p-1 steps")


def check_all_to_all(comm: md.Communicator, fn, shapes) -> list[dict]:
    """Rank body: ``fn`` and ``md.all_to_all`` on the same inputs, for each chunk shape in ``shapes``.

    Returns, per shape: whether the results are equal, the bytes ``fn`` sent and the input's bytes.
    Every library all-to-all is switched off while ``fn`` runs."""
    gen = torch.Generator().manual_seed(10 + comm.rank)
    results = []
    for chunk in shapes:
        t = torch.randn((comm.world_size, *chunk), generator=gen, dtype=torch.float64)
        want = md.all_to_all(comm, t)
        before = comm.stats.copy()
        with md.switched_off("Try it 1", *LIBRARY_ALL_TO_ALL):
            got = fn(comm, t)
        sent = (comm.stats - before).bytes_sent
        results.append({"equal": torch.equal(got, want), "sent": sent, "input_bytes": t.numel() * 8})
    return results
