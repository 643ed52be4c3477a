"""Worker functions of test_trace and test_emulated (they must live in an importable module)."""

from __future__ import annotations

import torch

import minidist as md
from minidist import trace


def traced_traffic(comm):
    """Point-to-point calls of known sizes, blocking and async collectives, all recorded.

    Returns the events and the traffic counters over exactly the recorded region
    (no barrier inside it: barrier messages are not point-to-point calls)."""
    rec = trace.Recorder(rank=comm.rank)
    trace.attach(comm, rec)
    workspace_kept = getattr(comm, "shared_workspace", None) is not None
    before = comm.stats
    peer = 1 - comm.rank if comm.rank < 2 else None
    if peer is not None:  # ranks 0 and 1 exchange 3 messages each way, one by keyword
        a, b = torch.arange(10.0), torch.zeros(10)
        if comm.rank == 0:
            comm.send(a, 1)
            comm.recv(b, src=1)
            work = comm.isend(torch.ones(100, dtype=torch.float64), dst=1)
            comm.irecv(torch.zeros(7, dtype=torch.int32), 1).wait()
            work.wait()
        else:
            comm.recv(b, 0)
            comm.send(a, dst=0)
            comm.irecv(torch.zeros(100, dtype=torch.float64), 0).wait()
            comm.isend(torch.zeros(7, dtype=torch.int32), 0).wait()
    with rec.span("allreduce ring", cat="comm"):
        md.allreduce(comm, torch.ones(1000), algorithm="ring")
    token = rec.begin("allreduce async", cat="comm", bytes=4000)
    handle = md.allreduce(comm, torch.ones(1000), algorithm="tree", async_op=True)
    with rec.span("backward"):
        torch.randn(100, 100) @ torch.randn(100, 100)
    handle.wait(timeout=60)
    rec.end(token)
    with rec.span("allreduce auto", cat="comm"):  # the shm fast path on shm: no messages at all
        md.allreduce(comm, torch.ones(1000))
    stats = comm.stats - before
    trace.detach(comm)
    md.allreduce(comm, torch.ones(1000), algorithm="ring")  # not recorded any more
    return {"events": rec.events, "stats": vars(stats), "workspace_kept": workspace_kept}
