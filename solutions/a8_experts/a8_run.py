"""Helpers of assignment 8's notebook and public tests: a layer on N ranks, and one process.

Every run builds the same router and E experts on every rank from a seed (rank r keeps experts
[r E/p, (r+1) E/p)), gives each rank its own tokens, runs one forward and one backward of your
``ExpertParallelMoE`` and reports the output, the gradients and the bytes sent. ``one_process``
computes the same with your ``route``, ``dispatch`` and ``combine`` and all E experts in this
process: the layer on p ranks must agree with your layer on one. Your ``experts`` module is
imported inside the worker processes only, afresh at every launch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

import minidist as md


@dataclass(frozen=True)
class Setup:
    """E experts (width -> hidden -> width) over ``ranks`` ranks, ``tokens`` tokens a rank."""

    experts: int = 4
    top_k: int = 2
    capacity_factor: float | None = 1.0
    tokens: int = 12
    width: int = 6
    hidden: int = 10
    ranks: int = 2
    seed: int = 0
    transport: str = "shm"


class Expert(nn.Module):
    """Linear -> tanh -> Linear, float64."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def make_layer(setup: Setup) -> tuple[nn.Linear, list[Expert]]:
    """The router (no bias) and all E experts, the same on every rank."""
    torch.manual_seed(setup.seed)
    router = nn.Linear(setup.width, setup.experts, bias=False).double()
    with torch.no_grad():
        router.weight.mul_(4.0)  # a peaked router: some experts get more than their share
    return router, [Expert(setup.width, setup.hidden).double() for _ in range(setup.experts)]


def tokens(setup: Setup, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens, and the weights w of its loss sum(y * w)."""
    g = torch.Generator().manual_seed(setup.seed * 1000 + rank)
    x = torch.randn(setup.tokens, setup.width, generator=g, dtype=torch.float64)
    return x, torch.randn(setup.tokens, setup.width, generator=g, dtype=torch.float64)


def run(worker, setup: Setup, *args, timeout: float = 60) -> list:
    return md.launch(worker, setup.ranks, args=(setup, *args), transport=setup.transport, timeout=timeout)


def layer_worker(comm, setup: Setup) -> dict:
    """One forward and backward of ``ExpertParallelMoE``: output, gradients, bytes sent."""
    experts = importlib.import_module("experts")
    router, all_experts = make_layer(setup)
    local = setup.experts // comm.world_size
    mine = all_experts[comm.rank * local : (comm.rank + 1) * local]
    before = comm.stats.bytes_sent  # as the grader counts: what building the layer sends counts too
    layer = experts.ExpertParallelMoE(router, mine, comm, setup.experts, setup.top_k, setup.capacity_factor)
    x, w = tokens(setup, comm.rank)
    x.requires_grad_(True)
    y = layer(x)
    (y * w).sum().backward()
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "router_grad": router.weight.grad,
        "expert_grads": [[p.grad for p in e.parameters()] for e in mine],
        "bytes": comm.stats.bytes_sent - before,
    }


def exchange_worker(comm, setup: Setup, shape: tuple[int, ...], rows: list[list[int]]) -> dict:
    """``all_to_all`` of equal pieces (world, *shape) and of uneven ones (rows[r][j] rows from r to j)."""
    experts = importlib.import_module("experts")
    p, r = comm.world_size, comm.rank
    equal = torch.arange(p * torch.Size(shape).numel(), dtype=torch.float64).view(p, *shape) + 1000 * r
    before = comm.stats.bytes_sent
    got_equal = experts.all_to_all(comm, equal)
    middle = comm.stats.bytes_sent
    uneven = [torch.full((n, 3), float(10 * r + j)) for j, n in enumerate(rows[r])]
    got_uneven = experts.all_to_all(comm, uneven)
    return {
        "equal": got_equal,
        "uneven": got_uneven,
        "bytes": [middle - before, comm.stats.bytes_sent - middle],
    }


def one_process(experts_module, setup: Setup) -> list[dict]:
    """Per rank: your layer on one process (``route``, ``dispatch``, every expert, ``combine``) on
    that rank's tokens; gradients of the sum of every rank's loss."""
    router_, all_experts = make_layer(setup)
    results, total = [], 0.0
    for rank in range(setup.ranks):
        router = nn.Linear(setup.width, setup.experts, bias=False).double()
        router.weight.data.copy_(router_.weight.data)
        x, w = tokens(setup, rank)
        x.requires_grad_(True)
        chosen, gates, slots = experts_module.route(router(x), setup.top_k, setup.capacity_factor)
        c = experts_module.capacity(setup.tokens, setup.top_k, setup.experts, setup.capacity_factor)
        buffer = experts_module.dispatch(x, chosen, slots, setup.experts, c)
        out = torch.stack([expert(buffer[e]) for e, expert in enumerate(all_experts)])
        y = experts_module.combine(out, chosen, slots, gates)
        total = total + (y * w).sum()
        results.append({"y": y.detach(), "x": x, "router": router})
    total.backward()
    local = setup.experts // setup.ranks
    for rank, result in enumerate(results):
        result["x_grad"] = result.pop("x").grad
        result["router_grad"] = result.pop("router").weight.grad
        mine = all_experts[rank * local : (rank + 1) * local]
        result["expert_grads"] = [[p.grad for p in e.parameters()] for e in mine]
    return results
