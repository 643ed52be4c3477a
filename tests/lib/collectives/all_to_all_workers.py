"""Workers for test_all_to_all.py: many all-to-all cases per launch, and ranks that disagree.

Every input is a function of (case, rank, world size), so the test process rebuilds every
rank's input and the expected outputs without running the collective.
"""

from __future__ import annotations

import torch

import minidist as md
from minidist.transport.emulated import EmulatedLinkComm

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}


def _values(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def equal_input(case: dict, rank: int, p: int) -> torch.Tensor:
    """Rank ``rank``'s (p, *chunk) input; ``noncontig``: the same values in permuted memory."""
    shape = (p, *case["chunk"])
    seed = case["seed"] * 1000 + rank
    if case.get("noncontig"):
        t = _values(shape[::-1], DTYPES[case["dtype"]], seed).permute(*reversed(range(len(shape))))
        assert not t.is_contiguous()
        return t
    return _values(shape, DTYPES[case["dtype"]], seed)


def split_rows(case: dict, rank: int, p: int) -> list[int]:
    """How many rows rank ``rank`` sends to each rank: uneven, with zeros."""
    return [(case["seed"] + 3 * rank + 5 * j) % 4 for j in range(p)]


def split_input(case: dict, rank: int, p: int) -> list[torch.Tensor]:
    rows = split_rows(case, rank, p)
    dtype = DTYPES[case["dtype"]]
    return [
        _values((n, *case["trailing"]), dtype, case["seed"] * 1000 + 10 * rank + j)
        for j, n in enumerate(rows)
    ]


def run_cases(comm, cases: list[dict]):
    """Run every case; return [(result, stats delta)] in order.

    Case kinds: "equal" (a (p, *chunk) tensor), "split" (a list; ``given``: pass
    recv_sizes), "async" (two equal ones in flight at once), "emulated" (an equal one
    over an emulated link wrapping ``comm``).
    """
    p, rank = comm.world_size, comm.rank
    out = []
    for case in cases:
        before = comm.stats
        kind = case["kind"]
        if kind == "equal":
            t = equal_input(case, rank, p)
            kept = t.clone()
            result = md.all_to_all(comm, t)
            assert torch.equal(t, kept), "the input was modified"
        elif kind == "split":
            pieces = split_input(case, rank, p)
            sizes = [split_rows(case, i, p)[rank] for i in range(p)] if case["given"] else None
            result = md.all_to_all(comm, pieces, recv_sizes=sizes)
        elif kind == "async":
            first = md.all_to_all(comm, equal_input(case, rank, p), async_op=True)
            second = md.all_to_all(comm, split_input(case, rank, p), async_op=True)
            result = (first.wait(timeout=60), second.wait(timeout=60))
        elif kind == "emulated":
            slow = EmulatedLinkComm(comm, alpha_s=1e-5, bandwidth_Bps=1e9)
            result = md.all_to_all(slow, equal_input(case, rank, p))
        else:
            raise ValueError(kind)
        out.append((result, vars(comm.stats - before)))
    return out


def disagreeing(comm, per_rank: list[str]):
    """Rank r makes call ``per_rank[r]``: ranks that disagree must raise MessageMismatch."""
    p = comm.world_size
    call = per_rank[comm.rank]
    if call == "equal":
        md.all_to_all(comm, torch.ones(p, 3))
    elif call == "split":
        md.all_to_all(comm, [torch.ones(2, 3) for _ in range(p)])
    elif call == "split_int":
        md.all_to_all(comm, [torch.ones(2, 3, dtype=torch.int64) for _ in range(p)])
    elif call == "split_wrong_sizes":  # says every rank sends it 1 row; they send 2
        md.all_to_all(
            comm,
            [torch.ones(2, 3) for _ in range(p)],
            recv_sizes=[2 if i == comm.rank else 1 for i in range(p)],
        )
    elif call == "allgather":
        md.allgather(comm, torch.ones(3))
    else:
        raise ValueError(call)
