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

**Counting lost updates** (``count_lost_updates=True``). A row's update is
``table.index_add_(0, rows, step)``: for every element, read it, add, write it back,
with nothing to stop another worker's write landing in between -- and then one of the
two additions is gone. To see how often that happens, every worker also adds 1 to a
shared *tally* ``tally[row]`` for each row update it makes, with the same unsynchronised
``index_add_``, right after the row's own update::

    worker 0: read tally[r] = 7   ...........   write 8
    worker 1:      read tally[r] = 7   write 8                 -> 8, not 9: one lost

At the end ``row_updates`` (2 per pair per epoch, known in advance) minus the tally's
sum is the number of increments the races swallowed. The tally races exactly the way
the rows do, one moment later, so it *samples* how often same-row updates collide; it
does not mark which of the table's updates were lost. The window between a read and
its write is a few nanoseconds, so expect few: a whole run may lose none.
"""

from __future__ import annotations

import torch

from ...comm import Communicator
from ...launch import launch
from ..model import DEFAULT_CONFIG, GloveConfig, Pairs, batch_step, init_gradsq, init_table
from .common import Clock, TrainResult, batch_slices, epochs, split, training_order


def count_row_updates(tally: torch.Tensor, rows: torch.Tensor) -> None:
    """``tally[r] += 1`` for every occurrence of ``r`` in ``rows``: unsynchronised, as the rows' update.

    ``index_add_`` reads, adds and writes each entry with no lock, so two workers
    counting the same row at the same moment can leave it one short.
    """
    tally.index_add_(0, rows, torch.ones(len(rows), dtype=tally.dtype))


def lost_updates(tally: torch.Tensor, row_updates: int) -> int:
    """Row updates made (``row_updates``) that the tally does not show: the increments races lost."""
    return row_updates - int(tally.sum())


def hogwild_worker(
    comm: Communicator,
    order: Pairs,
    table: torch.Tensor,
    gradsq: torch.Tensor,
    config: GloveConfig,
    progress: bool,
    tally: torch.Tensor | None = None,
) -> tuple[list[tuple[float, float]], float]:
    """AdaGrad steps on my part of the pairs, on the shared table; ``tally``: count them too.

    Returns per epoch (seconds, summed loss of my batches), and my training time.
    """
    mine = order.subset(split(len(order), comm.world_size, comm.rank))
    history = []
    comm.barrier()  # the only messages: start together
    clock = Clock()
    for _epoch in epochs(config.epochs, "hogwild", (progress and comm.rank == 0)):
        loss = 0.0
        for b in batch_slices(0, len(mine), config.batch_size):
            batch = mine.subset(b)
            loss += batch_step(table, gradsq, batch, config.lr)
            if tally is not None:
                count_row_updates(tally, torch.cat([batch.rows, batch.cols]))
        history.append((clock(), loss))
    return history, clock()


def train_hogwild(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    workers: int = 2,
    timeout: float = 600.0,
    progress: bool = False,
    count_lost_updates: bool = False,
) -> TrainResult:
    """Hogwild with ``workers`` processes on one shared table (see the module docstring).

    The result's ``row_updates`` is the number of row updates made (2 per pair per
    epoch). With ``count_lost_updates=True`` the workers keep the shared tally, and
    ``lost_updates`` says how many of its increments races lost (0 with one worker);
    ``extra["lost_per_row"]`` splits them by table row.
    """
    order = training_order(pairs, config).share_memory_()
    table = init_table(pairs.vocab_size, config.dim, config.seed).share_memory_()
    gradsq = init_gradsq(pairs.vocab_size, config.dim).share_memory_()
    tally = (
        torch.zeros(2 * pairs.vocab_size, dtype=torch.int64).share_memory_() if count_lost_updates else None
    )
    outs = launch(
        hogwild_worker,
        workers,
        args=(order, table, gradsq, config, progress, tally),
        transport="shm",
        timeout=timeout,
        threads_per_worker=1,
    )
    # An epoch ends when the slowest worker finishes it; its loss is the sum over workers.
    history = [
        (max(out[0][e][0] for out in outs), sum(out[0][e][1] for out in outs) / len(order))
        for e in range(config.epochs)
    ]
    row_updates = 2 * len(order) * config.epochs
    lost, extra = None, {}
    if tally is not None:
        lost = lost_updates(tally, row_updates)
        made = torch.bincount(torch.cat([order.rows, order.cols]), minlength=len(tally)) * config.epochs
        extra["lost_per_row"] = made - tally
    return TrainResult(
        "hogwild",
        table.clone(),
        gradsq.clone(),
        history,
        len(order) * config.epochs,
        max(out[1] for out in outs),
        workers,
        extra=extra,
        row_updates=row_updates,
        lost_updates=lost,
    )
