"""Trainer 3: model parallel -- the vocabulary's rows are sharded across workers.

Worker r owns the word rows ``w_i`` with ``i % p == r``; they never leave it. The
pairs fall into p x p blocks by (owner of the word, owner of the context). Blocks on
one "diagonal" touch disjoint rows, so p workers can update them at the same time
without talking at all. Between sub-epochs, the context rows move one step around
a ring (Gemulla et al.'s DSGD for matrix factorisation)::

    sub-epoch 0         sub-epoch 1          (p = 2; worker r holds w-shard r,
    worker 0: (w0, c0)  worker 0: (w0, c1)    and one context shard at a time)
    worker 1: (w1, c1)  worker 1: (w1, c0)
            \\ context shards pass to the left neighbour /

Per epoch a worker sends its context shard p times: about 2V/p x (dim + 1) floats
with AdaGrad's G -- no matter how many pairs there are. Data parallel sends per
*step*. That is why embeddings (huge tables, sparse updates) are usually sharded.

The updates equal those of the single-process trainer replaying the same schedule
(``schedule``): within a sub-epoch the workers' batches touch disjoint rows, so
applying them together or one after the other is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...collectives import allreduce
from ...comm import CommStats, Communicator
from ...launch import launch
from ..model import DEFAULT_CONFIG, GloveConfig, Pairs, batch_step, init_gradsq, init_table
from .common import Clock, TrainResult, batch_slices, epochs, total_bytes, training_order


def blocks(order: Pairs, workers: int) -> list[list[torch.Tensor]]:
    """``blocks[a][b]``: indices (into ``order``, in order) of pairs with word owner a, context owner b."""
    word_owner = order.rows % workers
    context_owner = (order.cols - order.vocab_size) % workers
    return [
        [torch.nonzero((word_owner == a) & (context_owner == b)).flatten() for b in range(workers)]
        for a in range(workers)
    ]


def context_shard(vocab_size: int, workers: int, shard: int) -> torch.Tensor:
    """Table rows ``V + j`` of the contexts j owned by ``shard``."""
    return torch.arange(shard, vocab_size, workers) + vocab_size


def schedule(order: Pairs, workers: int, batch_size: int) -> list[torch.Tensor]:
    """One epoch of the model-parallel trainer as a single-process batch list.

    Batch k of sub-epoch s is the union over workers r of batch k of block (r, (r + s) % p);
    a worker's batch is ``batch_size / workers`` pairs.
    """
    local = max(1, batch_size // workers)
    grid, out = blocks(order, workers), []
    for sub_epoch in range(workers):
        mine = [grid[r][(r + sub_epoch) % workers] for r in range(workers)]
        steps = max(-(-len(b) // local) for b in mine)
        for k in range(steps):
            out.append(torch.cat([b[k * local : (k + 1) * local] for b in mine]))
    return out


@dataclass(frozen=True)
class ShardReport:
    """What a model-parallel worker returns: the rows it owns at the end, and its measurements."""

    owned: torch.Tensor  # table rows: its word shard and (after p passes, again) its context shard
    table: torch.Tensor  # their final values
    gradsq: torch.Tensor  # and AdaGrad's G for them
    history: list[tuple[float, float]]  # per epoch: (seconds, mean loss over all workers)
    seconds: float
    stats: CommStats


def model_parallel_worker(
    comm: Communicator, order: Pairs, config: GloveConfig, progress: bool
) -> ShardReport:
    p, r, V = comm.world_size, comm.rank, order.vocab_size
    table, gradsq = init_table(V, config.dim, config.seed), init_gradsq(V, config.dim)
    grid = blocks(order, p)
    local = max(1, config.batch_size // p)
    left, right = (r - 1) % p, (r + 1) % p
    history = []
    comm.barrier()
    clock = Clock()
    for _epoch in epochs(config.epochs, "model parallel", (progress and r == 0)):
        loss = torch.zeros(1, dtype=torch.float64)
        for sub_epoch in range(p):
            held = (r + sub_epoch) % p  # the context shard this worker holds now
            block = order.subset(grid[r][held])
            for batch in batch_slices(0, len(block), local):
                loss += batch_step(table, gradsq, block.subset(batch), config.lr)
            if p > 1:  # pass the context shard (rows and their G) to the left, take the next from the right
                rows_out = context_shard(V, p, held)
                outgoing = torch.stack([table[rows_out], gradsq[rows_out]])
                send = comm.isend(outgoing, left)
                rows_in = context_shard(V, p, (held + 1) % p)
                incoming = torch.empty((2, len(rows_in), config.dim + 1))
                comm.recv(incoming, right)
                send.wait()
                table[rows_in], gradsq[rows_in] = incoming[0], incoming[1]
        allreduce(comm, loss, op="sum")
        history.append((clock(), float(loss) / len(order)))
    seconds = clock()
    # After p passes each worker holds its own context shard again.
    owned = torch.cat([torch.arange(r, V, p), context_shard(V, p, r)])
    return ShardReport(owned, table[owned], gradsq[owned], history, seconds, comm.stats)


def train_model_parallel(
    pairs: Pairs,
    config: GloveConfig = DEFAULT_CONFIG,
    *,
    workers: int = 2,
    transport: str = "shm",
    timeout: float = 600.0,
    progress: bool = False,
) -> TrainResult:
    """Model parallel over ``workers`` processes (see the module docstring)."""
    order = training_order(pairs, config).share_memory_()
    reports: list[ShardReport] = launch(
        model_parallel_worker,
        workers,
        args=(order, config, progress),
        transport=transport,
        timeout=timeout,
        threads_per_worker=1,
    )
    table = torch.empty(2 * pairs.vocab_size, config.dim + 1)
    gradsq = torch.empty_like(table)
    for report in reports:
        table[report.owned], gradsq[report.owned] = report.table, report.gradsq
    return TrainResult(
        "model parallel",
        table,
        gradsq,
        reports[0].history,  # every worker holds the same history: the loss was allreduced
        len(order) * config.epochs,
        max(report.seconds for report in reports),
        workers,
        total_bytes([report.stats for report in reports]),
    )
