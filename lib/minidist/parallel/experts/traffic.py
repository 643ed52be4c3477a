"""What expert parallelism sends, against tensor-parallel experts: formulas, and the TP layer to measure.

Two ways to spread E experts over p ranks:

    expert parallel (EP)        rank r holds whole experts [r E/p, (r+1) E/p); each rank routes
                                its own T tokens; every token's k rows travel to their experts'
                                ranks and back (two all_to_alls)
    tensor parallel (TP)        every rank holds a 1/p slice of EVERY expert (up: rows, down:
                                columns, Megatron's column/row split); the p ranks share the same
                                T tokens; each computes partial outputs, summed by one allreduce
                                of the (T, d) activations per layer

Bytes per token (forward, one MoE layer, s = bytes an element; bytes all ranks send divided by
the distinct tokens they process):

    EP   2 · k · d · s · f_off        f_off = the kept assignments whose expert is on another
                                      rank, as a fraction of ALL T·k assignments (dropped ones
                                      count in the denominator, they send nothing); (p-1)/p for
                                      uniform routing with nothing dropped
    TP   2 · (p-1) · d · s            a ring allreduce of T·d elements: each of the p ranks sends
                                      2 (p-1)/p of them, for T tokens

EP's bytes grow with k and not with p (beyond f_off), TP's grow with p and not with k: for k = 2
EP sends less than TP as soon as p > 2·f_off + 1 -- at p = 4, 3 d s against 6 d s; with
DeepSeek-V3's k = 8, 14 d s against 6 d s. EP also adds 8 (E/p)(p-1) bytes of counts per rank
per layer (latency, not bandwidth), and its loads are uneven; TP keeps its loads even.
``bytes_per_token`` returns both; the tests count ``comm.stats`` against ``ep_bytes`` and
``tp_bytes`` exactly.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from minidist.collectives import allreduce

from ...comm import Communicator
from .layer import MoELayer
from .routing import MoEStats, route

__all__ = ["bytes_per_token", "ep_bytes", "tp_bytes", "off_rank_assignments", "TensorParallelExperts"]


def off_rank_assignments(experts: torch.Tensor, kept: torch.Tensor, rank: int, experts_per_rank: int) -> int:
    """How many kept (token, slot) assignments of this rank go to an expert held by another rank."""
    owner = experts // experts_per_rank
    return int(((owner != rank) & kept).sum())


def ep_bytes(
    sent_off_rank: int, received_off_rank: int, d_model: int, itemsize: int, num_experts: int, world_size: int
) -> int:
    """Bytes one rank sends in one EP forward (backward: the same less the counts).

    counts 8·(E/p)·(p-1); dispatch: d·s per row of its own tokens bound for another rank
    (``sent_off_rank``); combine: d·s per row another rank sent it (``received_off_rank``), going
    back. Summed over the ranks both are the off-rank assignments, so all ranks together send
    2 · d · s per off-rank assignment: ``bytes_per_token``'s "ep" times the tokens.
    """
    counts = 8 * (num_experts // world_size) * (world_size - 1)
    return counts + (sent_off_rank + received_off_rank) * d_model * itemsize


def tp_bytes(tokens: int, d_model: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in one TP-experts forward: a ring allreduce of (T, d), 2 (p-1)/p · T·d·s.

    Exact when T·d is a multiple of p (the ring's chunks are then equal).
    """
    n = tokens * d_model
    if n % world_size:
        raise ValueError(f"T*d = {n} is not a multiple of p = {world_size}: the ring's chunks are uneven")
    return 2 * (world_size - 1) * (n // world_size) * itemsize


def bytes_per_token(
    d_model: int, top_k: int, world_size: int, itemsize: int = 2, off_rank_fraction: float | None = None
) -> dict[str, float]:
    """Forward bytes per token of one MoE layer, EP and TP side by side (see the module docstring).

    ``off_rank_fraction``: kept off-rank assignments / (T·k), defaults to (p-1)/p (uniform routing,
    no drops). Counts are left out of "ep".
    """
    p = world_size
    f_off = (p - 1) / p if off_rank_fraction is None else off_rank_fraction
    return {"ep": 2 * top_k * d_model * itemsize * f_off, "tp": 2 * (p - 1) * d_model * itemsize}


class _Copy(torch.autograd.Function):
    """Identity forward; backward: the sum of every rank's gradient (ring allreduce)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        allreduce(ctx.comm, grad, algorithm="ring")
        return grad, None


class _Sum(torch.autograd.Function):
    """The sum over the ranks forward (ring allreduce); identity backward."""

    @staticmethod
    def forward(ctx, x, comm):
        out = x.clone()
        allreduce(comm, out, algorithm="ring")
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TensorParallelExperts(nn.Module):
    """Every expert of ``moe`` split over ``comm``'s ranks (column/row); same tokens on every rank.

    Rank r keeps rows [r f/p, (r+1) f/p) of every expert's up (and gate) weight and the same
    columns of its down weight; the down bias is added once, after the sum. Forward: route
    (replicated), each expert's partial output on its kept rows, Σ gate · partial, one ring
    allreduce of the (T, d) result. Output and gradients equal to ``moe(x)``'s. Backward: one
    allreduce of the input's gradient (T·d) and one of the gates' (T·k).
    """

    def __init__(self, moe: MoELayer, comm: Communicator) -> None:
        super().__init__()
        p, r, f = comm.world_size, comm.rank, moe.d_ffn
        if f % p:
            raise ValueError(f"d_ffn {f} is not divisible by {p} ranks: pick a world size that divides it")
        if moe.shared is not None:
            raise ValueError(
                "TensorParallelExperts splits routed experts only: build the MoELayer without shared experts"
            )
        self.comm = comm
        self.d_model, self.num_experts, self.top_k = moe.d_model, moe.num_experts, moe.top_k
        self.capacity_factor, self.renormalize = moe.capacity_factor, moe.renormalize
        self.router = copy.deepcopy(moe.router)  # replicated
        rows = slice(r * f // p, (r + 1) * f // p)
        self.up, self.gate, self.down = nn.ParameterList(), nn.ParameterList(), nn.ParameterList()
        self.up_bias, self.down_bias = nn.ParameterList(), nn.ParameterList()
        for expert in moe.experts:
            self.up.append(nn.Parameter(expert.up.weight.detach()[rows].clone()))
            if expert.up.bias is not None:
                self.up_bias.append(nn.Parameter(expert.up.bias.detach()[rows].clone()))
                self.down_bias.append(nn.Parameter(expert.down.bias.detach().clone()))
            if expert.gate is not None:
                self.gate.append(nn.Parameter(expert.gate.weight.detach()[rows].clone()))
            self.down.append(nn.Parameter(expert.down.weight.detach()[:, rows].clone()))
        self.last_stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.d_model)
        routing = route(self.router(flat), self.top_k, self.capacity_factor, self.renormalize)  # replicated
        # f operators: the experts' input and the gates feed rank-local partial sums, so their
        # gradients are summed over the ranks in backward (the router's own work is replicated)
        rows, gates = _Copy.apply(flat, self.comm), _Copy.apply(routing.gates, self.comm)
        partial, bias = torch.zeros_like(flat), torch.zeros_like(flat)
        for e in range(self.num_experts):
            token, slot = torch.nonzero((routing.experts == e) & routing.kept, as_tuple=True)
            if not token.numel():
                continue
            h = rows[token] @ self.up[e].t()
            if len(self.up_bias):
                h = h + self.up_bias[e]
            h = F.silu(rows[token] @ self.gate[e].t()) * h if len(self.gate) else F.gelu(h)
            partial = partial.index_add(0, token, gates[token, slot].unsqueeze(1) * (h @ self.down[e].t()))
            if len(self.down_bias):  # whole on every rank: added after the sum, with the uncopied gates
                bias = bias.index_add(0, token, routing.gates[token, slot].unsqueeze(1) * self.down_bias[e])
        self.last_stats = routing.stats
        return (_Sum.apply(partial, self.comm) + bias).view(x.shape)
