"""Trainer 5: Hogwild -- several processes update one shared table without locks.

The table and AdaGrad's G live in shared memory (``share_memory_()``); every worker
maps the same pages. Worker r takes its part of the shuffled pairs and runs the
single-process loop on it, reading and writing the shared rows directly::

    worker 0: batch_step(shared table, its batch 0), batch_step(..., batch 1), ...
    worker 1: batch_step(shared table, its batch 0), ...        <- at the same time

Nothing orders the two: a worker may read a row halfway through the other's update,
and two ``+=`` on the same float can lose one of them. Niu et al. (2011) showed that
SGD converges anyway when each update touches few of the parameters -- here a batch
touches 2B of 2V rows, and most of those rows are rare words. No messages are sent;
the speed-up comes from using every core on the same memory, which is also why it
works on one machine only.

Hogwild is tested for convergence, not equality: its result depends on timing.
"""

from __future__ import annotations

import torch

from ...comm import Communicator
from ...launch import launch
from ..model import DEFAULT_CONFIG, GloveConfig, Pairs, batch_step, init_gradsq, init_table
from .common import Clock, TrainResult, batch_slices, epochs, split, training_order


def hogwild_worker(
    comm: Communicator,
    order: Pairs,
    table: torch.Tensor,
    gradsq: torch.Tensor,
    config: GloveConfig,
    progress: bool,
):
    mine = order.subset(split(len(order), comm.world_size, comm.rank))
    history = []
    comm.barrier()  # the only messages: start together
    clock = Clock()
    for _epoch in epochs(config.epochs, "hogwild", (progress and comm.rank == 0)):
        loss = sum(
            batch_step(table, gradsq, mine.subset(b), config.lr)
            for b in batch_slices(0, len(mine), config.batch_size)
        )
        history.append((clock(), loss))
    return history, clock()


def train_hogwild(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    workers: int = 2,
    timeout: float = 600.0,
    progress: bool = False,
) -> TrainResult:
    """Hogwild with ``workers`` processes on one shared table (see the module docstring)."""
    order = training_order(pairs, config).share_memory_()
    table = init_table(pairs.vocab_size, config.dim, config.seed).share_memory_()
    gradsq = init_gradsq(pairs.vocab_size, config.dim).share_memory_()
    outs = launch(
        hogwild_worker,
        workers,
        args=(order, table, gradsq, config, progress),
        transport="shm",
        timeout=timeout,
        threads_per_worker=1,
    )
    # An epoch ends when the slowest worker finishes it; its loss is the sum over workers.
    history = [
        (max(out[0][e][0] for out in outs), sum(out[0][e][1] for out in outs) / len(order))
        for e in range(config.epochs)
    ]
    return TrainResult(
        "hogwild",
        table.clone(),
        gradsq.clone(),
        history,
        len(order) * config.epochs,
        max(out[1] for out in outs),
        workers,
    )
