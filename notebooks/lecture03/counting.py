"""Workers for lecture 03, section 2 (Try it 1): co-occurrence counting in parallel, exactly."""

import numpy as np
import torch

import minidist as md
from minidist.glove.cooccur import count_documents, count_worker, shard_bounds
from minidist.parallel.messages import recv_rows, send_rows


def merge_counts(keys_a, units_a, keys_b, units_b):
    """Two sparse counts as one: sorted keys, the units of equal keys added (int64: exact)."""
    keys, units = np.concatenate([keys_a, keys_b]), np.concatenate([units_a, units_b])
    order = np.argsort(keys, kind="stable")
    keys, units = keys[order], units[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts], np.add.reduceat(units, starts)


def count_my_shard(comm, ids, lengths, vocab_size, window):
    """Rank r counts the r-th of p contiguous shards of the documents (about equal token counts).

    ``ids`` holds the word ids of all documents one after the other, ``lengths`` their lengths.
    Returns sorted keys ``i * vocab_size + j`` and their units (int64).
    """
    offsets = np.r_[0, np.cumsum(lengths.numpy())]
    first, last = shard_bounds(lengths.numpy(), comm.world_size)[comm.rank]
    shard = [ids.numpy()[offsets[k] : offsets[k + 1]] for k in range(first, last)]
    return count_documents(shard, vocab_size, window)


def count_and_reduce(comm, ids, lengths, vocab_size, window):
    """Count my shard, then add the p partial counts up a binomial tree to rank 0.

    Returns (keys, units) on rank 0, None on the other ranks::

        round 1:  1 -> 0   3 -> 2   5 -> 4 ...     (step 1: rank r sends when r % 2 == 1)
        round 2:  2 -> 0   6 -> 4                  (step 2: when r % 4 == 2)
        round 3:  4 -> 0                           (step 4: when r % 8 == 4)

    A rank that has sent is done; a rank that receives merges (``merge_counts``) and goes on.
    Every rank but 0 sends its list once; rank 0 receives ceil(log2 p) lists (a gather: p - 1).
    """
    keys, units = count_my_shard(comm, ids, lengths, vocab_size, window)
    # A count travels as one int64 tensor of n rows (key, units): send_rows(comm, tensor, dst)
    # sends it (its length first), recv_rows(comm, src, torch.int64, (2,)) receives it.
    raise NotImplementedError("TODO(Try it 1): add the partial counts up a binomial tree to rank 0")


def checked(comm, fn, *args):
    """``fn(comm, *args)`` and what this rank sent and received (``comm.stats``).

    The library's ``count_worker`` (what ``glove.count_parallel`` runs) is switched off meanwhile:
    the check is of your tree, not of the library's.
    """
    with md.switched_off("Try it 1", count_worker):
        return fn(comm, *args), comm.stats
