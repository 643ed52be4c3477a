"""Worker functions for the tests (they must live in an importable module)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import torch

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
}


def make_tensor(shape, dtype_name: str, seed: int) -> torch.Tensor:
    """A deterministic tensor: the same on every rank for the same arguments."""
    dtype = DTYPES[dtype_name]
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    if dtype == torch.bool:
        return values > 0
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def identity(comm):
    return comm.rank, comm.world_size, comm.local_rank, str(comm.device), os.getpid()


def add_args(comm, a, b=0, *, scale=1):
    return (comm.rank + a + b) * scale


def roundtrip(comm, specs):
    """Rank 0 sends one tensor per spec (shape, dtype, seed, send_noncontig, recv_noncontig);
    rank 1 receives each; both return what they hold, for the test to compare."""
    out = []
    for shape, dtype_name, seed, send_t, recv_t in specs:
        if comm.rank == 0:
            t = make_tensor(shape, dtype_name, seed)
            if send_t:  # same values, non-contiguous memory
                t = t.t().contiguous().t()
            comm.send(t, 1)
            out.append(t.clone())
        else:
            buf = torch.zeros(shape, dtype=DTYPES[dtype_name])
            if recv_t:
                buf = torch.zeros(tuple(reversed(shape)), dtype=DTYPES[dtype_name]).t()
            comm.recv(buf, 0)
            out.append(buf.clone())
    return out


def big_message(comm, nbytes: int):
    """Send an nbytes tensor with a position-dependent pattern; receiver checks it."""
    words = nbytes // 8
    if comm.rank == 0:
        comm.send(torch.arange(words, dtype=torch.int64), 1)
        return True
    buf = torch.empty(words, dtype=torch.int64)
    comm.recv(buf, 0)
    ok = torch.equal(buf, torch.arange(words, dtype=torch.int64))
    return ok


def async_ordering(comm, sizes):
    """Rank 0 posts isends of several sizes, then a blocking send; rank 1 posts irecvs."""
    if comm.rank == 0:
        tensors = [torch.full((n,), float(i + 1)) for i, n in enumerate(sizes)]
        works = [comm.isend(t, 1) for t in tensors]
        comm.send(torch.full((3,), -1.0), 1)  # queued behind the isends, never ahead of them
        for w in works:
            w.wait()
        return None
    bufs = [torch.zeros(n) for n in sizes]
    works = [comm.irecv(b, 0) for b in bufs]
    last = torch.zeros(3)
    comm.recv(last, 0)
    for w in works:
        w.wait()
    return [b.clone() for b in bufs] + [last]


def exchange(comm, numel: int):
    """Both ranks send a big tensor to each other at once (deadlocks with blocking sends)."""
    peer = 1 - comm.rank
    mine = torch.full((numel,), float(comm.rank + 1))
    theirs = torch.zeros(numel)
    work = comm.isend(mine, peer)
    comm.recv(theirs, peer)
    work.wait()
    return float(theirs[0]), float(theirs[-1])


def ring_pass(comm, numel: int):
    """Each rank sends to the next and receives from the previous; returns stats too."""
    p = comm.world_size
    before = comm.stats
    mine = torch.full((numel,), float(comm.rank))
    got = torch.empty(numel)
    work = comm.isend(mine, (comm.rank + 1) % p)
    comm.recv(got, (comm.rank - 1) % p)
    work.wait()
    delta = comm.stats - before
    return got, vars(delta)


def mismatched_shapes(comm):
    if comm.rank == 0:
        comm.send(torch.zeros(4, 2), 1)
    else:
        comm.recv(torch.zeros(8), 0)


def mismatched_dtypes(comm):
    if comm.rank == 0:
        comm.send(torch.zeros(8, dtype=torch.float64), 1)
    else:
        comm.recv(torch.zeros(8, dtype=torch.float32), 0)


def recv_vs_barrier(comm):
    if comm.rank == 0:
        comm.barrier()
    else:
        comm.recv(torch.zeros(2), 0)


def bad_calls(comm):
    """Each bad call must raise at once, on the calling rank, with a clear message."""
    errors = {}
    t = torch.zeros(2)
    for name, call in {
        "self": lambda: comm.send(t, comm.rank),
        "range": lambda: comm.send(t, comm.world_size),
        "negative": lambda: comm.recv(t, -1),
        "not_tensor": lambda: comm.send([1.0, 2.0], 1 - comm.rank),
        "float_rank": lambda: comm.isend(t, 1.0),
        "float_rank_send": lambda: comm.send(t, 1.0),
        "float_rank_recv": lambda: comm.recv(t, 1.0),
    }.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    return errors


def barrier_times(comm):
    time.sleep(0.15 * comm.rank)
    entered = time.time()
    comm.barrier()
    left = time.time()
    return entered, left


def peer_dies(comm, how: str):
    """Rank 1 dies; rank 0 is waiting for it in recv."""
    if comm.rank == 1:
        time.sleep(0.2)
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.recv(torch.zeros(4), 1)


# --- launcher failure modes ---------------------------------------------------------
def raise_in_rank(comm, bad_rank: int):
    if comm.rank == bad_rank:
        raise ValueError(f"deliberate failure in rank {comm.rank}")
    time.sleep(60)


def os_exit_in_rank(comm, code: int):
    if comm.rank == 1:
        os._exit(code)
    time.sleep(60)


def sys_exit_in_rank(comm):
    if comm.rank == 0:
        sys.exit(3)
    time.sleep(60)


def signal_in_rank(comm, sig: int):
    if comm.rank == 1:
        os.kill(os.getpid(), sig)
    time.sleep(60)


def deadlock(comm):
    """Both ranks wait for the other: the classic deadlock."""
    comm.recv(torch.zeros(4), 1 - comm.rank)


def busy_loop_forever(comm):
    x = 0
    while True:
        x += 1


def leave_a_child(comm, pid_dir: str):
    """Start a sleeping grandchild and return normally: launch must kill it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(pid_dir, f"rank{comm.rank}.pid"), "w") as f:
        f.write(str(child.pid))
    return child.pid


def sleep_and_record_pid(comm, pid_dir: str):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    with open(os.path.join(pid_dir, f"rank{comm.rank}.pid"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(120)


def print_something(comm):
    print(f"hello from rank {comm.rank}")
    print(f"a warning from rank {comm.rank}", file=sys.stderr)
    return comm.rank


def return_unpicklable(comm):
    return lambda: None


def cuda_pingpong(comm, numel: int):
    """GPU test: rank 0 sends a CUDA tensor to rank 1 and gets it back doubled."""
    t = torch.arange(numel, dtype=torch.float32, device=comm.device)
    if comm.rank == 0:
        comm.send(t, 1)
        comm.recv(t, 1)
    elif comm.rank == 1:
        comm.recv(t, 0)
        t *= 2
        comm.send(t, 0)
    return t.cpu()


def torchrun_ring(comm):
    """Used by the torchrun test: a ring pass across machines (node groups)."""
    p = comm.world_size
    mine = torch.full((5,), float(comm.rank))
    got = torch.zeros(5)
    work = comm.isend(mine, (comm.rank + 1) % p)
    comm.recv(got, (comm.rank - 1) % p)
    work.wait()
    comm.barrier()
    return {"rank": comm.rank, "world_size": p, "local_rank": comm.local_rank, "got": float(got[0])}


# --- collectives ---------------------------------------------------------------------
def rank_input(case: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input for a collective test case (the test recomputes it)."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    shape = case["shape"]
    dtype = DTYPES[case["dtype"]]
    if dtype in (torch.int64, torch.int32):
        t = torch.randint(-50, 50, shape, generator=gen, dtype=dtype)
    else:
        t = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if case.get("noncontig") and t.dim() == 2:
        t = t.t().contiguous().t()  # same values, column-major memory
        assert not t.is_contiguous() or t.numel() <= 1
    return t


def run_collectives(comm, cases):
    """Run every case; return [(result, stats delta)] in order."""
    import minidist as md

    out = []
    for case in cases:
        t = rank_input(case, comm.rank)
        before = comm.stats
        kind, algorithm = case["kind"], case.get("algorithm", "auto")
        if kind == "allreduce":
            result = md.allreduce(comm, t, op=case["op"], algorithm=algorithm)
            assert result is t
        elif kind == "broadcast":
            result = md.broadcast(comm, t, src=case["root"], algorithm=algorithm)
        elif kind == "reduce":
            result = md.reduce(comm, t, dst=case["root"], op=case["op"], algorithm=algorithm)
        elif kind == "allgather":
            result = md.allgather(comm, t)
        elif kind == "reduce_scatter":
            result = md.reduce_scatter(comm, t, op=case["op"])
        else:
            raise ValueError(kind)
        out.append((result.clone(), vars(comm.stats - before)))
    return out


def ours_and_gloo(comm, cases):
    """On the torch transport: our allreduce next to torch.distributed's, same inputs."""
    import torch.distributed as dist

    import minidist as md

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    out = []
    for case in cases:
        ours = md.allreduce(comm, rank_input(case, comm.rank), op=case["op"], algorithm=case["algorithm"])
        theirs = rank_input(case, comm.rank)
        dist.all_reduce(theirs, op=ops[case["op"]])
        out.append((ours, theirs))
    return out


def mismatched_allreduce(comm, algorithm, same_numel):
    import minidist as md

    if same_numel:
        t = torch.ones(2, 3) if comm.rank == 0 else torch.ones(3, 2)
    else:
        t = torch.ones(10) if comm.rank == 0 else torch.ones(12)
    md.allreduce(comm, t, algorithm=algorithm)


def allreduce_repeatedly(comm, sizes, algorithm):
    """Many back-to-back allreduces of changing sizes (exercises buffer reuse)."""
    import minidist as md

    results = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(comm.rank + i))
        md.allreduce(comm, t, algorithm=algorithm)
        results.append(float(t[0]) if n else None)
    return results


def tagged(comm, recv_tag: int):
    """Rank 0 sends with tag 7; rank 1 receives with ``recv_tag``."""
    t = torch.arange(4.0)
    if comm.rank == 0:
        comm.send(t, 1, tag=7)
        return None
    buf = torch.zeros(4)
    comm.recv(buf, 0, tag=recv_tag)
    return buf
