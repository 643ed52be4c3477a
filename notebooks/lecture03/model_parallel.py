"""Workers for lecture 03, section 4 (Try it 3): model parallel, the context shards' ring."""

import torch

from minidist.glove.model import batch_step, init_gradsq, init_table
from minidist.glove.trainers.common import batch_slices
from minidist.glove.trainers.model_parallel import blocks, context_shard


def pass_context_shard(comm, table, gradsq, held):
    """Hand the context shard I hold to my left neighbour; take the next one from my right.

    Context shard ``s`` is the table rows ``V + j`` with ``j % p == s`` (``context_shard(V, p, s)``).
    I hold shard ``held``; after the call I hold shard ``(held + 1) % p``, rows and AdaGrad's G
    as my right neighbour left them. Sends ``2 x len(shard) x (d + 1)`` floats: rows and G.
    """
    # Every rank sends at the same moment: a blocking send to the left while the left neighbour
    # also sends to its left can wait forever. comm.isend(tensor, dst) returns at once; .wait() it.
    raise NotImplementedError("TODO(Try it 3): pass the context shard around the ring")


def train_sharded(comm, order, config, pass_shard):
    """Model-parallel training (as ``glove.train_model_parallel``), passing shards with ``pass_shard``.

    Returns the rows I own (my word shard and my context shard), their values and G, my traffic.
    """
    p, r, vocab_size = comm.world_size, comm.rank, order.vocab_size
    table, gradsq = init_table(vocab_size, config.dim, config.seed), init_gradsq(vocab_size, config.dim)
    grid = blocks(order, p)  # grid[a][b]: the pairs whose word rank a owns, whose context shard is b
    local = max(1, config.batch_size // p)
    for _epoch in range(config.epochs):
        for sub_epoch in range(p):
            held = (r + sub_epoch) % p  # the context shard I hold now
            block = order.subset(grid[r][held])
            for batch in batch_slices(0, len(block), local):
                batch_step(table, gradsq, block.subset(batch), config.lr)
            pass_shard(comm, table, gradsq, held)
    owned = torch.cat([torch.arange(r, vocab_size, p), context_shard(vocab_size, p, r)])
    return owned, table[owned], gradsq[owned], comm.stats
