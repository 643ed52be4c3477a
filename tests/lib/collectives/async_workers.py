"""Worker functions of test_async_collectives (they must live in an importable module)."""

from __future__ import annotations

import os
import threading
import time

import torch

import minidist as md
from minidist.collectives import CollectiveStreamError

COMM_THREAD_PREFIX = "minidist-collectives"


def rank_input(rank: int, shape, seed: int) -> torch.Tensor:
    """Rank-specific, deterministic input (the test rebuilds it for its reference)."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _issue(comm, kind: str, t: torch.Tensor, algorithm: str, async_op: bool):
    if kind == "allreduce":
        return md.allreduce(comm, t, op="sum", algorithm=algorithm, async_op=async_op)
    if kind == "broadcast":
        return md.broadcast(comm, t, src=comm.world_size - 1, async_op=async_op)
    if kind == "reduce":
        return md.reduce(comm, t, dst=1, op="max", async_op=async_op)
    if kind == "allgather":
        return md.allgather(comm, t, async_op=async_op)
    if kind == "reduce_scatter":
        return md.reduce_scatter(comm, t, op="sum", async_op=async_op)
    raise ValueError(kind)


CASES = [  # (kind, algorithm, shape)
    ("allreduce", "auto", (1000,)),
    ("allreduce", "ring", (7, 5)),
    ("allreduce", "butterfly", (33,)),
    ("allreduce", "auto", (300_000,)),  # several pieces on shm, many messages elsewhere
    ("broadcast", "auto", (20,)),
    ("reduce", "auto", (9,)),
    ("allgather", "auto", (4, 3)),
    ("reduce_scatter", "auto", (6, 4)),
]


def async_and_blocking(comm, cases=CASES):
    """Every case run three ways, results returned for the test to compare with its reference:

    * all async handles outstanding at once, with a matmul between issuing and waiting;
    * blocking calls mixed in between async ones (they must queue behind them);
    * purely blocking.
    """
    algorithms = [algorithm for _, algorithm, _ in cases]
    inputs = [rank_input(comm.rank, shape, seed) for seed, (_, _, shape) in enumerate(cases)]
    work = [t.clone() for t in inputs]
    handles = [
        _issue(comm, kind, t, algorithm, async_op=True)
        for (kind, _, _), t, algorithm in zip(cases, work, algorithms, strict=True)
    ]
    a = torch.randn(200, 200)
    for _ in range(5):  # compute while the collectives run
        a = torch.tanh(a @ a / 200)
    many_at_once = [h.wait(timeout=60) for h in handles]
    completed = all(h.is_completed() for h in handles)

    mixed = []
    for i, ((kind, _, _), t, algorithm) in enumerate(zip(cases, inputs, algorithms, strict=True)):
        if i % 2:
            mixed.append(_issue(comm, kind, t.clone(), algorithm, async_op=False))
        else:
            mixed.append(_issue(comm, kind, t.clone(), algorithm, async_op=True))
    mixed = [m.wait(timeout=60) if isinstance(m, md.collectives.CollectiveWork) else m for m in mixed]

    blocking = [
        _issue(comm, kind, t.clone(), algorithm, async_op=False)
        for (kind, _, _), t, algorithm in zip(cases, inputs, algorithms, strict=True)
    ]
    return {"async": many_at_once, "mixed": mixed, "blocking": blocking, "completed": completed}


def stats_async_vs_blocking(comm, numel: int, algorithm: str):
    """Traffic counters of the same allreduce run blocking and then from the comm thread."""
    t = rank_input(comm.rank, (numel,), 0).float()
    comm.barrier()
    before = comm.stats
    md.allreduce(comm, t.clone(), algorithm=algorithm)
    blocking = comm.stats - before
    comm.barrier()
    before = comm.stats
    md.allreduce(comm, t.clone(), algorithm=algorithm, async_op=True).wait(timeout=60)
    from_thread = comm.stats - before
    return vars(blocking), vars(from_thread)


def errors_and_validation(comm):
    """What a student sees when things go wrong; returns a dict of observations."""
    seen = {}
    t = torch.ones(6)
    for name, call in [
        ("bad_op", lambda: md.allreduce(comm, t, op="median", async_op=True)),
        ("bad_algorithm", lambda: md.allreduce(comm, t, algorithm="magic", async_op=True)),
        ("not_divisible", lambda: md.reduce_scatter(comm, torch.ones(comm.world_size + 1), async_op=True)),
        ("bad_root", lambda: md.broadcast(comm, t, src=comm.world_size, async_op=True)),
    ]:
        try:
            call()
            seen[name] = "no error"
        except ValueError as error:  # raised at the call site, in this thread
            seen[name] = f"ValueError: {error}"
    seen["thread_started_by_bad_calls"] = any(
        th.name.startswith(COMM_THREAD_PREFIX) for th in threading.enumerate()
    )

    # wait(timeout) while the last rank is late: TimeoutError naming the collective; then it completes
    late = torch.full((4,), float(comm.rank))
    if comm.rank == comm.world_size - 1:
        time.sleep(1.0)
    handle = md.allreduce(comm, late, algorithm="ring", async_op=True)
    if comm.rank == 0:
        try:
            handle.wait(timeout=0.01)
            seen["timeout"] = "no error"
        except TimeoutError as error:
            seen["timeout"] = str(error)
    seen["late_result"] = handle.wait(timeout=60).tolist()

    # ranks that disagree on the shape: every rank's wait() raises the mismatch ...
    odd = torch.ones(4 + comm.rank)
    handle = md.allreduce(comm, odd, algorithm="ring", async_op=True)
    try:
        handle.wait(timeout=60)
        seen["mismatch"] = "no error"
    except md.MessageMismatch as error:
        seen["mismatch"] = f"MessageMismatch: {error}"
    # ... and the next collective, async or blocking, is refused, naming the first failure
    for name, call in [
        ("after_async", lambda: md.allreduce(comm, torch.ones(3), async_op=True)),
        ("after_blocking", lambda: md.allreduce(comm, torch.ones(3))),
    ]:
        try:
            call()
            seen[name] = "no error"
        except CollectiveStreamError as error:
            seen[name] = f"CollectiveStreamError: {error}"
    return seen


def die_while_others_wait(comm):
    """The last rank exits in the middle of a run; the others wait on an async allreduce."""
    t = torch.ones(10_000)
    md.allreduce(comm, t, algorithm="ring", async_op=True).wait(timeout=60)  # one that works
    if comm.rank == comm.world_size - 1:
        os._exit(3)
    return md.allreduce(comm, t, algorithm="ring", async_op=True).wait()


def threads_after_close(comm):
    """Names of comm threads before and after close() of a view of the communicator and of itself."""
    view = comm.without_shortcuts()
    # in flight at once: the view shares the communicator's thread, so they run one after the other
    h1 = md.allreduce(comm, torch.ones(8), async_op=True)
    # (a different shape: a slow rank still in the shm barrier could take a same-shape ring
    # message for a disagreement on algorithm)
    h2 = md.allreduce(view, torch.ones(9), algorithm="ring", async_op=True)
    h3 = md.allreduce(comm, torch.ones(8), algorithm="butterfly", async_op=True)
    results = [h.wait(timeout=60).tolist() for h in (h1, h2, h3)]

    def names():
        return sorted(th.name for th in threading.enumerate() if th.name.startswith(COMM_THREAD_PREFIX))

    before = names()
    view.close()
    after_view = names()
    # queued but not waited for: close() lets it run before the thread ends
    pending = md.allreduce(comm, torch.ones(8), algorithm="ring", async_op=True)
    comm.close()
    return {
        "results": results,
        "before": before,
        "after_view_close": after_view,
        "after_close": names(),
        "pending_done": pending.is_completed(),
        "pending_value": pending.wait(timeout=0).tolist(),
    }


def cuda_async_allreduce(comm):
    """CUDA tensors through the comm thread, with GPU work queued in between."""
    device = comm.device
    x = rank_input(comm.rank, (1 << 16,), 0).float().to(device)
    expected = sum(rank_input(r, (1 << 16,), 0).float() for r in range(comm.world_size))
    handles = [md.allreduce(comm, x.clone(), algorithm=a, async_op=True) for a in ("ring", "auto")]
    a = torch.randn(512, 512, device=device)
    for _ in range(10):
        a = torch.tanh(a @ a / 512)
    results = [h.wait(timeout=60) for h in handles]
    current = {}

    def where():
        current["device"] = str(torch.device("cuda", torch.cuda.current_device()))

    md.collectives.async_ops.stream_of(comm).submit("probe", where).wait(timeout=60)
    return {
        "on_device": [str(r.device) for r in results],
        "ok": [torch.allclose(r.cpu(), expected, rtol=1e-5, atol=1e-4) for r in results],
        "thread_device": current["device"],
        "comm_device": str(device),
    }
