"""Workers for the tests of agreement between ranks and of peers that are gone."""

from __future__ import annotations

import torch

import minidist as md
from minidist.parallel import Inbox


def disagreeing_collective(comm, kind: str, per_rank: list[dict]):
    """Run collective ``kind`` with rank r's keyword arguments ``per_rank[r]``.

    ``shape`` and ``dtype`` become the tensor; everything else goes to the collective.
    """
    kwargs = dict(per_rank[comm.rank])
    shape = kwargs.pop("shape", (4,))
    dtype = getattr(torch, kwargs.pop("dtype", "float32"))
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape).to(dtype) + comm.rank
    result = getattr(md, kind)(comm, t, **kwargs)
    return result.float().sum().item()


def _read_one(comm, src):
    buffer = torch.zeros(4)
    comm.recv(buffer, src)
    return buffer


def wait_for_peers_that_left(comm, operation: str):
    """Ranks >= 1 return at once; rank 0 then waits on them in ``operation``.

    Returns rank 0's error as (type name, message, type name of its cause)."""
    if comm.rank != 0:
        return None
    try:
        if operation == "recv":
            comm.recv(torch.zeros(4), 1)
        elif operation == "send":  # far more than the mailbox or the pipe can hold
            comm.send(torch.zeros(8 << 20), 1)
        elif operation == "barrier":
            comm.barrier()
        elif operation == "allreduce":
            md.allreduce(comm, torch.ones(4))
        elif operation == "inbox":  # the receiving happens on one thread per peer
            inbox = Inbox(comm, range(1, comm.world_size), _read_one)
            inbox.get()
        else:
            raise ValueError(operation)
    except Exception as error:
        cause = type(error.__cause__).__name__ if error.__cause__ is not None else ""
        return type(error).__name__, str(error), cause
    return "no error", "", ""


def plain_and_shortcut_allreduce(comm, numel: int):
    """The same allreduce through ``comm.without_shortcuts()`` and through ``comm``."""
    plain = comm.without_shortcuts()
    out = {"workspace": plain.shared_workspace is None, "same_rank": plain.rank == comm.rank}
    t = torch.arange(float(numel)) * (comm.rank + 1)
    before = comm.stats
    md.allreduce(plain, t)
    out["plain"] = (t, (comm.stats - before).bytes_sent)
    t = torch.arange(float(numel)) * (comm.rank + 1)
    before = comm.stats
    md.allreduce(comm, t)
    out["direct"] = (t, (comm.stats - before).bytes_sent)
    try:
        md.allreduce(plain, t, algorithm="shm")
        out["shm_on_plain"] = "no error"
    except ValueError as error:
        out["shm_on_plain"] = str(error)
    return out
