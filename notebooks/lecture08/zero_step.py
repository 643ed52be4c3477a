"""Lecture 08, Try it 1: one ZeRO-1 step written by hand, and the training run that checks it."""

import torch
from torch import nn

import minidist as md
from minidist.models.zero_training import make_data, make_model, my_rows


def zero1_step(
    comm: md.Communicator, params: list, flat: torch.Tensor, shard: nn.Parameter, optimizer
) -> None:
    """One ZeRO-1 step after ``loss.backward()``: every rank ends with all the updated weights.

    ``flat``: every weight, padded to N k elements (the ``params`` are views of it, in order);
    ``shard``: this rank's k elements of ``flat`` (rank r: ``flat[r k : (r + 1) k]``);
    ``optimizer``: steps ``shard`` only. Sends 2 k (N - 1) elements in 2 (N - 1) messages.
    """
    # md.reduce_scatter(comm, t, op="avg"): block `rank` (along dim 0) of the ranks' average of t
    # md.allgather(comm, t): every rank's t, stacked, shape (N, *t.shape)
    raise NotImplementedError(
        "TODO(Try it 1): reduce-scatter the gradient, step the shard, allgather the weights"
    )


def train_with_zero1(comm: md.Communicator, step, cfg: dict) -> dict:
    """Rank body of the check: ``cfg["steps"]`` steps of a decoder with ``step`` (your
    ``zero1_step``) as the optimizer step. Returns the final weights, the shard size k, and
    what this rank sent in the last step."""
    model = make_model(cfg)  # seeded: the same weights on every rank
    params = list(model.parameters())
    world, rank = comm.world_size, comm.rank
    k = -(-sum(p.numel() for p in params) // world)  # shard size: flat is padded to N k
    flat = torch.zeros(world * k, dtype=params[0].dtype)
    offset = 0
    for p in params:  # the parameters become views of flat
        flat[offset : offset + p.numel()] = p.detach().view(-1)
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    shard = nn.Parameter(flat[rank * k : (rank + 1) * k])  # shares flat's storage
    optimizer = torch.optim.AdamW([shard], lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    for ids in make_data(cfg):
        mine = my_rows(ids, rank, cfg)
        model(mine, labels=mine).loss.backward()
        comm.reset_stats()
        step(comm, params, flat, shard, optimizer)
        sent = comm.stats.copy()
        for p in params:
            p.grad = None
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"weights": weights, "k": k, "sent": sent}
