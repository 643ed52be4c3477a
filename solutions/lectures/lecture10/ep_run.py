"""Lecture 10, section 3: one MoE layer expert-parallel on p ranks, against one process, and its bytes."""

import torch

from minidist.parallel import experts


def make_layer(seed: int = 0, d: int = 16, ffn: int = 32, num_experts: int = 8, top_k: int = 2, cf=1.25):
    """The same one-process layer on every rank (and in the notebook): float64, seeded."""
    torch.manual_seed(seed)
    return experts.MoELayer(d, ffn, num_experts, top_k=top_k, capacity_factor=cf).double()


def tokens(rank: int, n: int = 24, d: int = 16) -> torch.Tensor:
    """Rank ``rank``'s n tokens (a different batch on every rank)."""
    return torch.randn(n, d, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def ep_body(comm, seed: int = 0) -> dict:
    """Rank body: ``ExpertParallelMoE`` on this rank's tokens, forward + backward, beside ``MoELayer``
    on the same tokens in this process; the bytes each phase sent; then the TP-sharded experts."""
    moe = make_layer(seed)
    x = tokens(comm.rank)
    # one process: the whole layer, this rank's tokens
    ref_x = x.clone().requires_grad_(True)
    ref = moe(ref_x)
    ref.pow(2).sum().backward()
    # expert parallel: E/p experts here
    ep = experts.ExpertParallelMoE(moe, comm)
    ep_x = x.clone().requires_grad_(True)
    s0 = comm.stats.copy()
    y = ep(ep_x)
    s1 = comm.stats.copy()
    y.pow(2).sum().backward()
    s2 = comm.stats.copy()
    expert_grads = {  # global expert id -> its parameters' gradients, summed over every rank's tokens
        ep.first_expert + j: {name: q.grad for name, q in ffn.named_parameters()}
        for j, ffn in enumerate(ep.experts)
    }
    routing = ep.route(x)
    off = experts.off_rank_assignments(routing.experts, routing.kept, comm.rank, ep.per_rank)
    # tensor-parallel experts: every rank holds 1/p of every expert; the group sees the same tokens
    tp_layer = experts.TensorParallelExperts(moe, comm)
    shared_x = tokens(0)
    t0 = comm.stats.copy()
    with torch.no_grad():
        tp_out = tp_layer(shared_x)
    t1 = comm.stats.copy()
    with torch.no_grad():
        tp_ref = moe(shared_x)
    return {
        "out_gap": (y - ref).abs().max().item(),
        "input_grad_gap": (ep_x.grad - ref_x.grad).abs().max().item(),
        "router_grad_gap": (ep.router.weight.grad - moe.router.weight.grad).abs().max().item(),
        "expert_grads": expert_grads,
        "forward_bytes": (s1 - s0).bytes_sent,
        "backward_bytes": (s2 - s1).bytes_sent,
        "off_rank": off,
        "received": ep.received,
        "rows_from": ep.rows_from,
        "stats": ep.last_stats,
        "tp_gap": (tp_out - tp_ref).abs().max().item(),
        "tp_forward_bytes": (t1 - t0).bytes_sent,
    }
