"""Worker functions for tests/lib/parallel/test_context.py (importable by md.launch workers).

The test process builds the full-sequence q, k, v and the output gradient (``make_case``) and
computes the reference itself; each worker takes its shard (``context.shard_sequence``), runs
ring attention (every dtype x causal x layout) and Ulysses attention forward and backward, and
returns its shards of the output and the gradients, the bytes and messages it sent in each
pass (the transport's counters), the tiles it computed (``RingCounter``) and the bytes of the
tensors autograd saved for backward (a ``saved_tensors_hooks`` pack hook that records every
distinct storage). On 4 ranks it also runs the short point of ``python -m minidist.bench
context`` (ring and Ulysses forward on the emulated clock).
"""

from __future__ import annotations

import torch

from minidist.bench import context as bench_context
from minidist.parallel import context

BATCH, SEQ, HEAD_DIM = 2, 24, 8  # 24 cuts into p and 2p blocks for p = 2, 3, 4
HEADS = 12  # divisible by 2, 3 and 4 (Ulysses)
DTYPES = (torch.float64, torch.float32)
SHORT_POINT = bench_context.POINTS[0]  # python -m minidist.bench context: "short sequence"


def make_case(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    case = {}
    for dtype in DTYPES:
        for name in ("q", "k", "v", "grad_out"):
            case[name, dtype] = torch.randn(
                BATCH, HEADS, SEQ, HEAD_DIM, generator=gen, dtype=torch.float64
            ).to(dtype)
    return case


def _saved_bytes(fn):
    """Run fn(); return (its result, bytes of the distinct storages autograd saved meanwhile)."""
    storages: dict[int, int] = {}
    keep = []

    def pack(t):
        keep.append(t)
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def _run(comm, attend, case, dtype, layout):
    p, r = comm.world_size, comm.rank
    q, k, v, grad_out = (
        context.shard_sequence(case[n, dtype], r, p, layout).requires_grad_(n != "grad_out")
        for n in ("q", "k", "v", "grad_out")
    )
    before = comm.stats
    out, saved = _saved_bytes(lambda: attend(q, k, v))
    middle = comm.stats
    out.backward(grad_out)
    after = comm.stats
    return {
        "out": out.detach(),
        "grads": (q.grad, k.grad, v.grad),
        "bytes": ((middle - before).bytes_sent, (after - middle).bytes_sent),
        "messages": ((middle - before).messages_sent, (after - middle).messages_sent),
        "saved_bytes": saved,
    }


def all_checks(comm, case: dict) -> dict:
    p = comm.world_size
    results = {}
    for dtype in DTYPES:
        for causal in (False, True):
            for layout in context.LAYOUTS:
                counter = context.RingCounter()

                def ring(q, k, v, causal=causal, layout=layout, counter=counter):
                    return context.ring_attention(
                        q, k, v, comm, causal=causal, layout=layout, counter=counter
                    )

                res = _run(comm, ring, case, dtype, layout)
                res["counter"] = counter
                results["ring", dtype, causal, layout] = res

                def ulysses(q, k, v, causal=causal, layout=layout):
                    return context.ulysses_attention(q, k, v, comm, causal=causal, layout=layout)

                results["ulysses", dtype, causal, layout] = _run(comm, ulysses, case, dtype, layout)
    errors = {}
    odd = torch.zeros(1, 2, 3, 4)  # 3 tokens a rank: no zig-zag split into two blocks
    try:
        context.ring_attention(odd, odd, odd, comm, layout="zigzag")
    except ValueError as e:
        errors["ring_odd"] = str(e)
    heads = torch.zeros(1, p + 1, 2, 4)  # p + 1 heads: p never divides them
    try:
        context.ulysses_attention(heads, heads, heads, comm)
    except ValueError as e:
        errors["ulysses_heads"] = str(e)
    results["errors"] = errors
    if p == 4:  # the benchmark's emulated-clock measurement, its short point once (~0.2 s)
        results["emulated"] = bench_context._worker(comm, (SHORT_POINT,), 1)
    return results
