"""Worker functions for tests/lib/parallel/test_parallel.py (importable by the worker processes)."""

from __future__ import annotations

import time

import torch

from minidist.parallel import Inbox, recv_rows, send_rows


def rows_roundtrip(comm, lengths):
    """Rank 0 sends tensors of the given first dimensions; rank 1 returns what arrived."""
    if comm.rank == 0:
        for n in lengths:
            send_rows(comm, torch.arange(n * 3, dtype=torch.float64).reshape(n, 3), 1)
        return None
    return [recv_rows(comm, 0, torch.float64, (3,)) for _ in lengths]


def _read(comm, src):
    message = recv_rows(comm, src, torch.int64)
    return None if len(message) == 0 else message


def inbox_server(comm, delays):
    """Rank 0 collects from everyone in arrival order; rank r sleeps delays[r] before each message."""
    if comm.rank == 0:
        inbox = Inbox(comm, range(1, comm.world_size), _read)
        arrivals, done = [], 0
        while done < comm.world_size - 1:
            src, message = inbox.get(timeout=30)
            if message is None:
                done += 1
            else:
                arrivals.append((src, message.tolist()))
        return arrivals
    for k in range(3):
        time.sleep(delays[comm.rank])
        send_rows(comm, torch.tensor([comm.rank, k]), 0)
    send_rows(comm, torch.zeros(0, dtype=torch.int64), 0)
    return None


def inbox_peer_fails(comm):
    """Rank 1 sends half a message (a length, then dies): rank 0's inbox must report it."""
    if comm.rank == 0:
        inbox = Inbox(comm, [1], lambda c, src: recv_rows(c, src, torch.float32, (4,)))
        return inbox.get(timeout=30)
    comm.send(torch.tensor([5]), 0)
    raise RuntimeError("worker 1 gives up")
