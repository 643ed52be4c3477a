"""Trainer 2: synchronous data parallel -- every worker a full replica of the table.

Each global batch of B pairs is split into p parts; worker r computes the gradient
rows of its part on its own replica, the workers combine what they computed, and
every replica applies the same combined update, so the replicas never drift::

    worker 0: pairs[0 : B/p]   --grads-->  \\
    worker 1: pairs[B/p : 2B/p] --grads--> -- combine --> same update on every replica
    ...                                    /

Two ways to combine, and what each sends per step (V words, d = dim + 1 floats per row):

* ``"dense"``: each worker scatters its updates into a zero table-sized tensor
  (the change of the table and of AdaGrad's G) and allreduces it: 2 x 2V x d floats,
  however few rows the batch touched. This is what a framework that sees "a
  gradient tensor" does.
* ``"sparse"``: allgather the touched rows and their gradients: 2B/p row ids and
  2B/p x d floats from every worker, independent of V. Every worker then applies all
  p parts -- the update is replicated, not split.

Either way the result equals the single-process trainer with the same global batch
(up to the order of floating-point additions), which the tests check.
"""

from __future__ import annotations

import torch

from ...collectives import allgather, allreduce
from ...comm import Communicator
from ...launch import launch
from ..model import (
    DEFAULT_CONFIG,
    GloveConfig,
    Pairs,
    adagrad_update,
    init_gradsq,
    init_table,
    pair_gradients,
)
from .common import Clock, TrainResult, batch_slices, epochs, split, total_bytes, training_order

VARIANTS = ("dense", "sparse")


def _dense_step(comm: Communicator, table, gradsq, rows, grads, lr):
    delta = torch.zeros((2, *table.shape))  # [change of table, change of G]
    step = grads / gradsq.index_select(0, rows).sqrt_()
    delta[0].index_add_(0, rows, step.mul_(-lr))  # scaled first, as in adagrad_update
    delta[1].index_add_(0, rows, grads.square_())
    allreduce(comm, delta, op="sum", algorithm="ring")  # ring: its bytes are counted
    table += delta[0]
    gradsq += delta[1]


def _sparse_step(comm: Communicator, table, gradsq, rows, grads, lr, part_size):
    # Pad every part to the same size (allgather needs equal shapes); padding rows
    # carry zero gradients, which change nothing.
    padded_rows = torch.zeros(2 * part_size, dtype=torch.int64)
    padded_grads = torch.zeros(2 * part_size, grads.shape[1])
    half, mine = part_size, len(rows) // 2
    padded_rows[:mine], padded_rows[half : half + mine] = rows[:mine], rows[mine:]
    padded_grads[:mine], padded_grads[half : half + mine] = grads[:mine], grads[mine:]
    all_rows = allgather(comm, padded_rows).reshape(-1)
    all_grads = allgather(comm, padded_grads).reshape(-1, grads.shape[1])
    adagrad_update(table, gradsq, all_rows, all_grads, lr)


def data_parallel_worker(comm: Communicator, order: Pairs, config: GloveConfig, variant: str, progress: bool):
    torch.manual_seed(config.seed)
    table, gradsq = (
        init_table(order.vocab_size, config.dim, config.seed),
        init_gradsq(order.vocab_size, config.dim),
    )
    part_size = -(-config.batch_size // comm.world_size)
    history = []
    comm.barrier()  # start the clocks together
    clock = Clock()
    show = progress and comm.rank == 0
    for _epoch in epochs(config.epochs, f"data parallel ({variant})", show):
        loss = torch.zeros(1, dtype=torch.float64)
        for batch in batch_slices(0, len(order), config.batch_size):
            mine = order.subset(slice(batch.start, batch.stop)).subset(
                split(batch.stop - batch.start, comm.world_size, comm.rank)
            )
            rows = torch.cat([mine.rows, mine.cols])
            grads, batch_loss = pair_gradients(table.index_select(0, rows), mine.log_x, mine.f_x)
            loss += float(batch_loss)
            if variant == "dense":
                _dense_step(comm, table, gradsq, rows, grads, config.lr)
            else:
                _sparse_step(comm, table, gradsq, rows, grads, config.lr, part_size)
        allreduce(comm, loss, op="sum")
        history.append((clock(), float(loss) / len(order)))
    seconds = clock()
    if comm.rank == 0:
        return table, gradsq, history, seconds, comm.stats
    return comm.stats


def train_data_parallel(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    workers: int = 2,
    variant: str = "sparse",
    transport: str = "shm",
    timeout: float = 600.0,
    progress: bool = False,
) -> TrainResult:
    """Synchronous data parallel over ``workers`` processes (see the module docstring)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    order = training_order(pairs, config).share_memory_()
    outs = launch(
        data_parallel_worker,
        workers,
        args=(order, config, variant, progress),
        transport=transport,
        timeout=timeout,
        threads_per_worker=1,
    )
    table, gradsq, history, seconds, stats0 = outs[0]
    return TrainResult(
        f"data parallel ({variant})",
        table,
        gradsq,
        history,
        len(order) * config.epochs,
        seconds,
        workers,
        total_bytes([stats0, *outs[1:]]),
    )
