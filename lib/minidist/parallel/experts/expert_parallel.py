"""Expert parallelism: each of p ranks holds E/p experts; tokens travel to their experts and back.

Rank r holds experts [r E/p, (r+1) E/p) and a replica of the router; it routes its OWN tokens
exactly as the one-process ``MoELayer`` would route that batch (same top-k, same capacity rule,
applied to this rank's T tokens: C = ceil(cf · T · k / E) per expert per source rank, GShard's
"capacity per group"), then:

    rank 0 tokens ─┐ dispatch            ┌─ rank 0: experts 0,1 ─┐ combine             ┌─► rank 0: Σ gate·y
    rank 1 tokens ─┼── all_to_all ──────►├─ rank 1: experts 2,3 ─┼── all_to_all ───────┼─► rank 1: Σ gate·y
    rank 2 tokens ─┘ (rows grouped by    └─ rank 2: experts 4,5 ─┘ (the reverse split) └─► rank 2: Σ gate·y
                      destination rank)

1. route: kept assignments sorted by expert -- one contiguous block of rows per destination
   rank; an all_to_all of the counts (p × E/p int64) tells each rank how many rows of each of
   its experts every rank sends.
2. dispatch: ``md.all_to_all(comm, pieces, recv_sizes=...)``, piece j = the rows for rank j.
3. run each local expert on its rows (from every source rank).
4. combine: the same all_to_all with the sizes swapped sends every result back to the rank
   (and the row) it came from; the token's output is Σ gate · result over its kept choices.

Backward is the same picture reversed: the gradient of an all_to_all is the all_to_all of the
gradients with the send and receive sizes swapped (``_AllToAll``), so every rank must call
backward (as in tensor parallelism). Gradients: a local expert's gradient is the sum over every
rank's tokens (they all came here); the router's is this rank's tokens' only -- average it with
the other data-parallel replicas as for any replicated weight.

Bytes sent by one rank, forward (``traffic.ep_bytes``): 8·(E/p)·(p-1) for the counts, then
d · itemsize for every kept assignment whose expert lives on another rank, twice (there and
back): with uniform routing 2 · k · d · itemsize · (p-1)/p per token. Backward: the same again.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from minidist.collectives import all_to_all

from ...comm import Communicator
from .layer import MoELayer
from .routing import MoEStats, Routing, route

__all__ = ["ExpertParallelMoE", "distribute_experts"]


class _AllToAll(torch.autograd.Function):
    """Rows ``x`` split by ``send_sizes`` go to ranks 0..p-1; returns what arrived, concatenated.

    Backward: the gradient rows go back where they came from (sizes swapped). ``anchor`` (the
    router's weight) is an input only so that every rank's graph reaches this function: a rank
    whose experts got no rows would otherwise skip this backward and leave the others waiting.
    """

    @staticmethod
    def forward(ctx, x, anchor, send_sizes: list[int], recv_sizes: list[int], comm: Communicator):
        ctx.comm, ctx.send_sizes, ctx.recv_sizes = comm, send_sizes, recv_sizes
        return torch.cat(all_to_all(comm, list(x.split(send_sizes)), recv_sizes=recv_sizes))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pieces = list(grad.contiguous().split(ctx.recv_sizes))
        back = all_to_all(ctx.comm, pieces, recv_sizes=ctx.send_sizes)
        return torch.cat(back), None, None, None, None


class ExpertParallelMoE(nn.Module):
    """``moe``'s experts spread over ``comm``'s ranks; forward/backward equal to ``moe`` on each rank's batch.

    Built from a one-process ``MoELayer`` (every rank passes the same one, e.g. built from the
    same seed): the router and the shared experts are copied whole, the routed experts
    [rank·E/p, (rank+1)·E/p) are copied into ``self.experts``. ``self.last_stats`` is the
    routing of this rank's tokens (as ``moe.last_stats`` would be on this batch);
    ``self.received[j]`` the rows local expert j received from all ranks in the last forward,
    ``self.rows_from[i]`` the rows that came from rank i (this rank's own included).
    """

    def __init__(self, moe: MoELayer, comm: Communicator) -> None:
        super().__init__()
        p, num_experts = comm.world_size, moe.num_experts
        if num_experts % p:
            raise ValueError(
                f"{num_experts} experts cannot be split evenly over {p} ranks: expert parallelism "
                f"gives every rank E/p experts; use a world size that divides {num_experts}"
            )
        self.comm = comm
        self.per_rank = num_experts // p
        self.first_expert = comm.rank * self.per_rank
        self.d_model, self.num_experts, self.top_k = moe.d_model, num_experts, moe.top_k
        self.router = copy.deepcopy(moe.router)
        self.shared = copy.deepcopy(moe.shared)
        local = range(self.first_expert, self.first_expert + self.per_rank)
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[e]) for e in local)
        self.aux_loss: torch.Tensor | None = None
        self.last_stats: MoEStats | None = None
        self.received: list[int] = []
        self.rows_from: list[int] = []
        # the routing rule's settings (no reference to ``moe``: its other experts can be freed)
        self.capacity_factor, self.renormalize = moe.capacity_factor, moe.renormalize

    def route(self, x: torch.Tensor) -> Routing:
        """This rank's routing of the rows of ``x`` (T, d): the one-process layer's rule."""
        return route(self.router(x), self.top_k, self.capacity_factor, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm, p, per = self.comm, self.comm.world_size, self.per_rank
        flat = x.reshape(-1, self.d_model)
        routing = self.route(flat)
        token, slot, expert = routing.assignments()  # sorted by expert: one block per destination

        # 1. how many rows of each of my experts will each rank send me?
        counts = torch.bincount(expert, minlength=self.num_experts).view(p, per)
        from_each = all_to_all(comm, counts)  # (p, per): row i = rank i's counts for my experts
        send_sizes = counts.sum(1).tolist()
        recv_sizes = from_each.sum(1).tolist()

        # 2. dispatch
        arrived = _AllToAll.apply(flat[token], self.router.weight, send_sizes, recv_sizes, comm)

        # 3. my experts; the rows that arrived are grouped by source rank, then by expert
        local_id = torch.repeat_interleave(
            torch.arange(per, device=flat.device).repeat(p), from_each.reshape(-1)
        )
        results = arrived * 0  # (not zeros_like: the dispatch's backward must run even with no rows here)
        for j, expert_ffn in enumerate(self.experts):
            rows = torch.nonzero(local_id == j).squeeze(1)
            if rows.numel():
                results = results.index_copy(0, rows, expert_ffn(arrived[rows]))
        self.received, self.rows_from = from_each.sum(0).tolist(), recv_sizes

        # 4. combine: the results go back in the order the rows were sent
        back = _AllToAll.apply(results, self.router.weight, recv_sizes, send_sizes, comm)
        weighted = back * routing.gates[token, slot].unsqueeze(1)
        out = torch.zeros_like(flat).index_add(0, token, weighted)
        if self.shared is not None:
            out = out + self.shared(flat)
        self.aux_loss, self.last_stats = routing.aux_loss, routing.stats
        return out.view(x.shape)


def distribute_experts(model: nn.Module, comm: Communicator) -> nn.Module:
    """Swap every ``MoELayer`` inside ``model`` for its ``ExpertParallelMoE`` on ``comm`` (in place).

    Every rank calls it on the same model (same seed); each keeps its E/p experts of every layer.
    Returns ``model``. A local expert j of a layer is global expert ``layer.first_expert + j``.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, MoELayer):
            setattr(model, name, ExpertParallelMoE(child, comm))
        else:
            distribute_experts(child, comm)
    return model
