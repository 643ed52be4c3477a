"""Workers for the tests of the shared-memory allreduce's pipelined path (large vectors)."""

from __future__ import annotations

import hashlib

import torch

DTYPES = {
    name: getattr(torch, name)
    for name in ["float32", "float64", "bfloat16", "float16", "int64", "int32", "int8", "uint8", "bool"]
}
DTYPES["complex64"] = torch.complex64


def rank_input(case: dict, rank: int) -> torch.Tensor:
    """Small integers (exact in every dtype, so any order of summation gives the same sum)."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank)
    dtype, shape = DTYPES[case["dtype"]], case["shape"]
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    elif dtype == torch.uint8:
        t = torch.randint(0, 9, shape, generator=gen, dtype=torch.uint8)
    elif dtype == torch.complex64:
        t = torch.complex(*(torch.randint(-8, 9, shape, generator=gen).float() for _ in range(2)))
    else:
        t = torch.randint(-8, 9, shape, generator=gen).to(dtype)
    if case.get("noncontig"):
        t = t.t().contiguous().t()  # same values, column-major memory
        assert not t.is_contiguous()
    return t


def reference(case: dict, world_size: int) -> torch.Tensor:
    """The allreduce computed in one process, in float64/int64/bool."""
    inputs = [rank_input(case, r) for r in range(world_size)]
    dtype = inputs[0].dtype
    if dtype.is_complex:
        wide = [t.to(torch.complex128) for t in inputs]
    elif dtype.is_floating_point:
        wide = [t.to(torch.float64) for t in inputs]
    elif dtype == torch.bool:
        wide = inputs
    else:
        wide = [t.to(torch.int64) for t in inputs]
    stacked = torch.stack(wide)
    op = case["op"]
    if op == "max":
        out = stacked.max(dim=0).values
    elif op == "min":
        out = stacked.min(dim=0).values
    else:
        out = stacked.sum(dim=0)
        if op == "avg":
            floor = not (dtype.is_floating_point or dtype.is_complex)
            out = torch.div(out, world_size, rounding_mode="floor") if floor else out / world_size
    return out.to(dtype)


def allreduce_against_reference(comm, cases):
    """Run every case with algorithm="shm"; per case: (matches the reference, digest of the
    result's bytes -- equal on all ranks when the ranks agree bit for bit)."""
    import minidist as md

    out = []
    for case in cases:
        t = rank_input(case, comm.rank)
        result = md.allreduce(comm, t, op=case["op"], algorithm="shm")
        assert result is t and t.shape == tuple(case["shape"])
        want = reference(case, comm.world_size)
        if (t.dtype.is_floating_point or t.dtype.is_complex) and case["op"] == "avg":  # rounding may differ
            atol = 1e-2 if t.dtype in (torch.bfloat16, torch.float16) else 1e-6
            ok = torch.allclose(t.to(want.dtype), want, rtol=atol, atol=atol)
        else:
            ok = torch.equal(t, want)
        digest = hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        out.append((ok, digest))
    return out


def mismatch_then_agree(comm, sizes):
    """Rank 0 passes a small vector, the others a large one: every rank gets a
    MessageMismatch. Then all allreduce matching vectors: the results must be right
    (the ranks stayed in step although one took the small path and others the large)."""
    import minidist as md
    from minidist.errors import MessageMismatch

    t = torch.ones(100 if comm.rank == 0 else 300_000)
    try:
        md.allreduce(comm, t, algorithm="shm")
        error = None
    except MessageMismatch as caught:
        error = str(caught)
    results = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(comm.rank + i))
        md.allreduce(comm, t, algorithm="shm")
        results.append(float(t.min()) == float(t.max()) and float(t[0]))
    return error, results


def large_allreduce_after_peers_left(comm):
    """Rank 0 enters a large allreduce; the other ranks have returned."""
    import minidist as md
    from minidist.errors import PeerError

    if comm.rank != 0:
        return None
    try:
        md.allreduce(comm, torch.ones(1_000_000), algorithm="shm")
    except PeerError as error:
        return "PeerError", str(error)
    return "no error", ""


def shm_then_plain_same_tensor(comm, rounds: int) -> int:
    """An shm allreduce, then at once a ring allreduce of a tensor of the same shape, many times;
    rank 0 sometimes dawdles, so the others wait in the shm barrier while a fast peer's first
    ring message is already there (it belongs to the next call, not to a disagreement)."""
    import random
    import time

    import minidist as md

    pause = random.Random(comm.rank)
    for _ in range(rounds):
        if comm.rank == 0 and pause.random() < 0.3:
            time.sleep(0.004)  # long enough for the waiters to reach the sleeping phase
        x = torch.ones(1000)
        md.allreduce(comm, x)  # the shm path
        md.allreduce(comm, torch.ones(1000), algorithm="ring")
        assert torch.equal(x, torch.full((1000,), float(comm.world_size)))
    return rounds
