"""Trainer 1: one process -- the baseline every parallel trainer is compared with.

    for epoch in range(epochs):
        for batch in consecutive slices of the shuffled pairs:
            table, G <- AdaGrad step on the batch           (model.batch_step)

One step per batch of ``config.batch_size`` pairs; glove.c is the same loop with a
batch of one pair (and two threads, Hogwild-style).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model import DEFAULT_CONFIG, GloveConfig, Pairs, batch_step, init_gradsq, init_table
from .common import Clock, TrainResult, batch_slices, epochs, training_order


def train_single(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    batches: Sequence[torch.Tensor] | None = None,
    progress: bool = False,
) -> TrainResult:
    """Train in this process with one thread.

    ``batches``: optional explicit schedule of one epoch, index tensors into the
    shuffled pairs (tests use it to replay a parallel trainer's order of updates).
    """
    order = training_order(pairs, config)
    table, gradsq = (
        init_table(pairs.vocab_size, config.dim, config.seed),
        init_gradsq(pairs.vocab_size, config.dim),
    )
    schedule = batches if batches is not None else list(batch_slices(0, len(order), config.batch_size))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, like each worker of the parallel trainers
    try:
        history, clock = [], Clock()
        for _epoch in epochs(config.epochs, "single", progress):  # no process-wide lock in a worker
            loss = sum(batch_step(table, gradsq, order.subset(b), config.lr) for b in schedule)
            history.append((clock(), loss / len(order)))
        seconds = clock()
    finally:
        torch.set_num_threads(threads)
    return TrainResult("single", table, gradsq, history, len(order) * config.epochs, seconds)
