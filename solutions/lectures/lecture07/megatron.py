"""Lecture 07, Try it 2: the Megatron MLP on ranks, and the rank body that checks it."""

import torch
import torch.nn.functional as F
from torch import nn

import minidist as md


def megatron_mlp(comm: md.Communicator, x: torch.Tensor, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    """Z = down(GeLU(up(x))), computed Megatron-style by ``comm.world_size`` ranks; Z on every rank.

    Rank r uses its 1/p of the columns of A (rows of ``up.weight``, which stores Aᵀ) and of
    ``up.bias``, and its 1/p of the rows of B (columns of ``down.weight``); one allreduce (g)
    sums the partial products; ``down.bias`` is added once, after the sum. Forward only.
    Sends what one allreduce of Z's size sends.
    """
    # F.linear(x, w, bias) = x @ w.T + bias, the same as nn.Linear with your slices of its weight
    # md.allreduce(comm, t) sums t over the ranks, in place
    ### BEGIN SOLUTION TODO(Try it 2): your slices, GeLU, the partial product, one allreduce, the bias once
    p, r = comm.world_size, comm.rank
    width = up.out_features // p
    mine = slice(r * width, (r + 1) * width)
    y = F.gelu(F.linear(x, up.weight[mine], up.bias[mine]))  # X A_r + a_r, then GeLU: (..., 4d/p)
    partial = F.linear(y, down.weight[:, mine])  # Y_r B_r: a partial sum, Z's shape
    md.allreduce(comm, partial)  # g
    return partial + down.bias
    ### END SOLUTION


def check_megatron_mlp(comm: md.Communicator, mlp, d_model: int, x: torch.Tensor) -> dict:
    """Rank body of the check: the same dense MLP on every rank (seeded); Z from ``mlp`` (your
    ``megatron_mlp``) and the dense Z, what ``mlp`` sent, and what one ``md.allreduce`` of Z's shape sends."""
    torch.manual_seed(0)
    up, down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
    with torch.no_grad():
        comm.reset_stats()
        z = mlp(comm, x, up, down)
        sent = comm.stats.copy()
        comm.reset_stats()
        md.allreduce(comm, torch.zeros(x.shape[:-1] + (d_model,)))
        one_allreduce = comm.stats.copy()
        dense = down(F.gelu(up(x)))
    return {"z": z, "dense": dense, "sent": sent, "one_allreduce": one_allreduce}
