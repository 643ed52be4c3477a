"""Lecture 07, Try it 2: the Megatron MLP on ranks, and the rank body that checks it."""

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

import minidist as md
from minidist.parallel import tensor as tp


def megatron_mlp(comm: md.Communicator, x: torch.Tensor, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    """Z = down(GeLU(up(x))), computed Megatron-style by ``comm.world_size`` ranks; Z on every rank.

    Rank r uses its 1/p of the columns of A (rows of ``up.weight``, which stores Aᵀ) and of
    ``up.bias``, and its 1/p of the rows of B (columns of ``down.weight``); one allreduce (g)
    sums the partial products; ``down.bias`` is added once, after the sum. Forward only.
    Sends what one allreduce of Z's size sends. The other ranks' slices of ``up`` and ``down``
    are not this rank's to use (the check fills them with NaN).
    """
    # F.linear(x, w, bias) = x @ w.T + bias, the same as nn.Linear with your slices of its weight
    # md.allreduce(comm, t) sums t over the ranks, in place
    raise NotImplementedError(
        "TODO(Try it 2): your slices, GeLU, the partial product, one allreduce, the bias once"
    )


def check_megatron_mlp(comm: md.Communicator, mlp, d_model: int, x: torch.Tensor) -> dict:
    """Rank body of the check: the same dense MLP on every rank (seeded) and its Z; then Z from
    ``mlp`` (your ``megatron_mlp``), handed copies of the layers that hold only this rank's slices
    (NaN elsewhere), with the library's tensor-parallel layers switched off; what ``mlp`` sent, and
    what one ``md.allreduce`` of Z's shape sends."""
    torch.manual_seed(0)
    up, down = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)
    with torch.no_grad():
        dense = down(F.gelu(up(x)))
        width = up.out_features // comm.world_size
        others = torch.ones(up.out_features, dtype=torch.bool)
        others[comm.rank * width : (comm.rank + 1) * width] = False  # the slices of the other ranks
        my_up, my_down = copy.deepcopy(up), copy.deepcopy(down)
        my_up.weight[others] = math.nan  # rows of up.weight: the other ranks' columns of A
        my_up.bias[others] = math.nan
        my_down.weight[:, others] = math.nan  # columns of down.weight: the other ranks' rows of B
        comm.reset_stats()
        with md.switched_off("Try it 2", tp.ColumnParallelLinear, tp.RowParallelLinear, tp.ParallelMLP):
            z = mlp(comm, x, my_up, my_down)
        sent = comm.stats.copy()
        comm.reset_stats()
        md.allreduce(comm, torch.zeros(x.shape[:-1] + (d_model,)))
        one_allreduce = comm.stats.copy()
    return {"z": z, "dense": dense, "sent": sent, "one_allreduce": one_allreduce}
