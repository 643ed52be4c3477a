"""Lecture 10, section 4: ring attention (zig-zag) and Ulysses on p ranks, and what each rank holds."""

import torch

from minidist.parallel import context


def qkv(batch: int = 1, heads: int = 4, seq: int = 32, head_dim: int = 8) -> list[torch.Tensor]:
    """The whole sequence's q, k, v (b, a, S, d), float64, the same on every rank and in the notebook."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(batch, heads, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(3)]


def saved_bytes(fn):
    """Run fn(); return (its result, bytes of the distinct storages autograd saved for backward)."""
    storages: dict[int, int] = {}
    keep = []  # hold every saved tensor, so that no storage is freed and its address reused

    def pack(t):
        keep.append(t)
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def context_body(comm, shape: tuple) -> dict:
    """Rank body: this rank's shard of q, k, v; ring attention (zig-zag and contiguous, causal),
    forward + backward, with its tiles, bytes and the bytes it saves for backward; Ulysses forward."""
    p, r = comm.world_size, comm.rank
    full = qkv(*shape)
    out: dict = {}
    for layout in ("zigzag", "contiguous"):
        q, k, v = (context.shard_sequence(t, r, p, layout).clone().requires_grad_(True) for t in full)
        counter = context.RingCounter()
        s0 = comm.stats.copy()
        y, saved = saved_bytes(
            lambda: context.ring_attention(q, k, v, comm, causal=True, layout=layout, counter=counter)
        )
        s1 = comm.stats.copy()
        y.backward(torch.ones_like(y))
        s2 = comm.stats.copy()
        out[layout] = {
            "out": y.detach(),
            "grads": [t.grad for t in (q, k, v)],
            "tiles": counter.tiles_forward,
            "largest_tile": counter.largest_tile,
            "forward_bytes": (s1 - s0).bytes_sent,
            "backward_bytes": (s2 - s1).bytes_sent,
            "saved_bytes": saved,
        }
    q, k, v = (context.shard_sequence(t, r, p, "contiguous") for t in full)
    s0 = comm.stats.copy()
    with torch.no_grad():
        u = context.ulysses_attention(q, k, v, comm, causal=True)
    out["ulysses"] = {"out": u, "forward_bytes": (comm.stats - s0).bytes_sent}
    return out
