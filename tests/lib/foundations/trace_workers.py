"""Worker functions of test_trace and test_emulated (they must live in an importable module)."""

from __future__ import annotations

import time

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
    # not recorded any more. (Another shape: a same-shape ring allreduce right after the shm one
    # can be mistaken by a slow rank, still in the shm barrier, for a disagreement on algorithm.)
    md.allreduce(comm, torch.ones(999), algorithm="ring")
    return {"events": rec.events, "stats": vars(stats), "workspace_kept": workspace_kept}


# --- the emulated link ----------------------------------------------------------------------
def timed_sends(comm, alpha_s: float, bandwidth_Bps: float, nbytes: int):
    """Rank 0 sends to rank 1 over the emulated link: seconds of a send, an isend+wait, and
    two isends in a row (which share the link)."""
    from minidist.transport.emulated import EmulatedLinkComm

    slow = EmulatedLinkComm(comm, alpha_s, bandwidth_Bps)
    t = torch.arange(nbytes, dtype=torch.uint8)
    times = {}
    if comm.rank == 0:
        start = time.perf_counter()
        slow.send(t, 1)
        times["send"] = time.perf_counter() - start
        start = time.perf_counter()
        slow.isend(t, 1).wait()
        times["isend"] = time.perf_counter() - start
        start = time.perf_counter()
        works = [slow.isend(t, 1), slow.isend(t, 1)]
        for work in works:
            work.wait()
        times["two_isends"] = time.perf_counter() - start
    elif comm.rank == 1:
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        received = []
        for _ in range(4):
            slow.recv(buf, 0)
            received.append(torch.equal(buf, t))
        times["received_intact"] = all(received)
    slow.close()
    return times


def emulated_collectives(comm, alpha_s: float, bandwidth_Bps: float):
    """Every collective through the emulated link, blocking and async, and the same on the
    plain communicator; plus what the emulated view reports about itself."""
    from minidist.collectives.api import choose_allreduce
    from minidist.transport.emulated import EmulatedLinkComm

    slow = EmulatedLinkComm(comm, alpha_s, bandwidth_Bps)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(comm.rank), dtype=torch.float64)
    rows = torch.randn(3 * comm.world_size, 2, generator=torch.Generator().manual_seed(comm.rank))

    def run_all(c, async_op):
        outs = []
        for algorithm in ("star", "tree", "ring", "butterfly"):
            outs.append(md.allreduce(c, x.clone(), algorithm=algorithm, async_op=async_op))
        outs.append(md.broadcast(c, x.clone(), src=1, async_op=async_op))
        outs.append(md.reduce(c, x.clone(), dst=0, op="max", async_op=async_op))
        outs.append(md.allgather(c, rows, async_op=async_op))
        outs.append(md.reduce_scatter(c, rows, async_op=async_op))
        return [o.wait(timeout=60) if async_op else o for o in outs]

    before = comm.stats
    emulated_blocking = run_all(slow, False)
    traffic = vars(slow.stats - before)
    emulated_async = run_all(slow, True)
    plain = run_all(comm, False)
    facts = {
        "workspace": slow.shared_workspace,
        "auto": choose_allreduce(slow, 4096),
        "rank": slow.rank,
        "world_size": slow.world_size,
        "traffic_counted": traffic["messages_sent"] > 0,
    }
    slow.close()
    return {"emulated": emulated_blocking, "emulated_async": emulated_async, "plain": plain, "facts": facts}


def timed_ring_allreduce(comm, alpha_s: float, bandwidth_Bps: float, numel: int, async_op: bool):
    """Seconds of one float32 ring allreduce over the emulated link (after a warm-up)."""
    from minidist.transport.emulated import EmulatedLinkComm

    slow = EmulatedLinkComm(comm, alpha_s, bandwidth_Bps)
    x = torch.ones(numel)
    md.allreduce(slow, x.clone(), algorithm="ring")
    comm.barrier()
    start = time.perf_counter()
    result = md.allreduce(slow, x, algorithm="ring", async_op=async_op)
    if async_op:
        result.wait(timeout=120)
    seconds = time.perf_counter() - start
    slow.close()
    return seconds, bool((x == comm.world_size).all())
