"""Workers for lecture 03, section 4 (Try it 2): the exchange of sparse data parallel."""

import torch

import minidist as md
from minidist.glove.model import adagrad_update, init_gradsq, init_table, pair_gradients
from minidist.glove.trainers import data_parallel as library
from minidist.glove.trainers.common import batch_slices, split


def sparse_exchange(comm, table, gradsq, rows, grads, lr, part_size):
    """Apply the whole batch's AdaGrad step to my replica, from my part's gradient rows and everyone's.

    ``rows``: the table rows my part of the batch touched (``2n`` for ``n`` pairs, repeats included),
    ``grads``: their gradient rows (``2n x (d + 1)``). Every rank has at most ``part_size`` pairs.
    After the call every replica has taken the step one process takes on the whole batch
    (``glove.model.adagrad_update`` with all ranks' rows and gradients at once, so that every
    pair sees G as it was at the start of the step).
    Sends per rank ``(p - 1) * 2 * part_size * (8 + 4 (d + 1))`` bytes: ids (int64) and rows (float32).
    """
    # md.allgather(comm, x) returns a tensor of shape (p, *x.shape): row r is rank r's x. All ranks'
    # x must have the same shape: pad to 2 * part_size rows (a zero gradient changes neither the
    # table nor G, whatever its row id).
    raise NotImplementedError(
        "TODO(Try it 2): allgather the touched rows and their gradients, apply them all"
    )


def train_steps(comm, order, config, exchange, steps):
    """``steps`` synchronous data-parallel steps whose ranks combine with ``exchange``.

    Returns my replica of the table and my traffic (``comm.stats``). The library's own exchanges
    are switched off meanwhile: the check is of ``exchange``, not of the library's.
    """
    table = init_table(order.vocab_size, config.dim, config.seed)
    gradsq = init_gradsq(order.vocab_size, config.dim)
    part_size = -(-config.batch_size // comm.world_size)  # ceil(B / p)
    for batch in list(batch_slices(0, len(order), config.batch_size))[:steps]:
        size = batch.stop - batch.start
        mine = order.subset(batch).subset(split(size, comm.world_size, comm.rank))  # my part
        rows = torch.cat([mine.rows, mine.cols])
        grads, _ = pair_gradients(table.index_select(0, rows), mine.log_x, mine.f_x)
        with md.switched_off("Try it 2", library._sparse_step, library._dense_step):
            exchange(comm, table, gradsq, rows, grads, config.lr, part_size)
    return table, comm.stats
