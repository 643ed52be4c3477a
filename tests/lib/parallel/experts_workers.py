"""Worker functions for tests/lib/parallel/test_experts.py (importable by md.launch workers).

Every rank builds the same one-process ``MoELayer`` from a seed (``build``) and its own batch
(``batch``); the test process builds the same ones and computes the reference itself. One
``all_cases`` call per world size runs every case and returns plain tensors and ints.
"""

from __future__ import annotations

import torch

from minidist.parallel import experts

D, FFN, EXPERTS, TOKENS = 8, 24, 12, 12  # 12 experts, d_ffn 24, T·d 96: divisible by 2, 3 and 4 ranks
AUX_WEIGHT = 0.1

CASES = {
    # name: MoELayer settings, skew of the router towards experts 0 and 1
    "no-drop-gelu-top2": dict(
        top_k=2, capacity_factor=None, activation="gelu", bias=True, shared=0, skew=0.0
    ),
    "drop-gelu-top2": dict(top_k=2, capacity_factor=1.0, activation="gelu", bias=True, shared=0, skew=3.0),
    "drop-swiglu-top1-shared": dict(
        top_k=1, capacity_factor=1.25, activation="swiglu", bias=False, shared=1, skew=3.0
    ),
}


def build(case: str) -> experts.MoELayer:
    c = CASES[case]
    torch.manual_seed(1234)
    moe = experts.MoELayer(
        D,
        FFN,
        EXPERTS,
        top_k=c["top_k"],
        capacity_factor=c["capacity_factor"],
        activation=c["activation"],
        bias=c["bias"],
        num_shared_experts=c["shared"],
    ).double()
    with torch.no_grad():  # skew: tokens (shifted along the all-ones direction) prefer experts 0, 1
        moe.router.weight[0] += c["skew"] / D
        moe.router.weight[1] += c["skew"] / (2 * D)
    return moe


def batch(case: str, rank: int, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens (tokens, D) and the weights of its loss, sum(y * w)."""
    g = torch.Generator().manual_seed(100 + rank)
    shift = 1.0 if CASES[case]["skew"] else 0.0
    x = torch.randn(tokens, D, generator=g, dtype=torch.float64) + shift
    return x, torch.randn(tokens, D, generator=g, dtype=torch.float64)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient by name (zeros where no token reached it)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in module.named_parameters()
    }


def run_ep(comm, case: str) -> dict:
    moe = build(case)
    ep = experts.ExpertParallelMoE(moe, comm)
    x, w = batch(case, comm.rank)
    x.requires_grad_(True)
    before = comm.stats.copy()
    y = ep(x)
    forward = comm.stats - before
    loss = (y * w).sum() + AUX_WEIGHT * ep.aux_loss
    before = comm.stats.copy()
    loss.backward()
    backward = comm.stats - before
    routing = ep.route(x.detach())  # the same decisions, to count off-rank rows
    off = experts.off_rank_assignments(routing.experts, routing.kept, comm.rank, ep.per_rank)
    return {
        "y": y.detach(),
        "aux": ep.aux_loss.detach(),
        "x_grad": x.grad,
        "grads": grads(ep),
        "stats": ep.last_stats,
        "received": ep.received,
        "rows_from": ep.rows_from,
        "first_expert": ep.first_expert,
        "forward_bytes": forward.bytes_sent,
        "forward_messages": forward.messages_sent,
        "backward_bytes": backward.bytes_sent,
        "off_rank": off,
    }


def run_tp(comm, case: str) -> dict:
    """TP-sharded experts: every rank has rank 0's batch; output, input gradient, bytes."""
    moe = build(case)
    tp = experts.TensorParallelExperts(moe, comm)
    x, w = batch(case, 0)
    x.requires_grad_(True)
    before = comm.stats.copy()
    y = tp(x)
    forward = comm.stats - before
    (y * w).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "forward_bytes": forward.bytes_sent}


def refuses_uneven(comm) -> str:
    moe = experts.MoELayer(D, FFN, comm.world_size + 1)
    try:
        experts.ExpertParallelMoE(moe, comm)
    except ValueError as error:
        return str(error)
    return ""


def decoder_model():
    """A 2-layer MoE decoder (rotary, grouped-query attention, SwiGLU experts, capacity 1.0), float64."""
    from dataclasses import replace

    from minidist.models import decoder

    cfg = replace(
        decoder.CONFIGS["moe-tiny"], hidden_size=32, n_heads=4, intermediate_size=48, num_experts=12
    )
    torch.manual_seed(7)
    return decoder.DecoderLM(replace(cfg, capacity_factor=1.0)).double()


def decoder_batch(rank: int) -> torch.Tensor:
    return torch.randint(0, 8192, (2, 6), generator=torch.Generator().manual_seed(200 + rank))


def run_decoder(comm) -> dict:
    """The decoder with its MoE layers expert-parallel: loss, logits, every gradient, the drops."""
    model = experts.distribute_experts(decoder_model(), comm)
    ids = decoder_batch(comm.rank)
    out = model(ids, labels=ids)
    out.loss.backward()
    mlps = [block.mlp for block in model.transformer.blocks]
    return {
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        "grads": grads(model),
        "first_expert": [m.first_expert for m in mlps],
        "dropped": [m.last_stats.dropped_total for m in mlps],
    }


def all_cases(comm) -> dict:
    out = {case: run_ep(comm, case) for case in CASES}
    out["decoder"] = run_decoder(comm)
    out["tp"] = run_tp(comm, "no-drop-gelu-top2")
    out["uneven"] = refuses_uneven(comm)
    return out
