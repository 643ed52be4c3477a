"""Co-occurrence counts, in one process or as a parallel job.

For every pair of words ``(i, j)`` at distance ``d <= window`` inside a document,
``X[i, j]`` and ``X[j, i]`` grow by ``1/d`` (a symmetric window with 1/distance
weighting, as in Stanford's ``cooccur``). Pairs of a word with itself are dropped:
the GloVe loss sums over ``i != j``.

**Exact in parallel.** Floating-point sums depend on their order, so a parallel count
would differ from the single-process one in the last bits. We count in integer
*units* instead: a pair at distance ``d`` adds ``lcm(1..window) / d`` units, an exact
integer, and integer addition is associative. Any split of the documents, merged in
any order, gives bit-identical counts; ``X = units / lcm(1..window)`` at the end.

**Parallel job** (``count_parallel``): the documents are split into contiguous
shards of about equal token count, each rank counts its shard, and the sparse
partial counts are summed up a binomial tree (log2 p rounds, like ``md.reduce``,
but the messages are sorted (key, units) lists whose lengths differ)::

    round 1:  1 -> 0   3 -> 2   5 -> 4 ...
    round 2:  2 -> 0   6 -> 4
    round 3:  4 -> 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..comm import Communicator
from ..parallel.messages import recv_rows, send_rows

MAX_WINDOW = 20  # lcm(1..20) * counts stays far below 2**63


@dataclass(frozen=True)
class Cooccurrence:
    """Sparse symmetric counts: ``X[rows[k], cols[k]] = units[k] / scale``, sorted by (row, col)."""

    vocab_size: int
    window: int
    rows: np.ndarray  # int64
    cols: np.ndarray  # int64
    units: np.ndarray  # int64, exact

    @property
    def scale(self) -> int:
        return weight_scale(self.window)

    @property
    def counts(self) -> np.ndarray:
        return self.units / self.scale

    def __len__(self) -> int:
        return len(self.rows)


def weight_scale(window: int) -> int:
    """Units per co-occurrence at distance 1: every 1/d, d <= window, is a whole number of units."""
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"window must be between 1 and {MAX_WINDOW}, got {window}")
    return math.lcm(*range(1, window + 1))


def _sum_duplicates(keys: np.ndarray, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort by key and add up the units of equal keys (exactly: int64)."""
    if len(keys) == 0:
        return keys.astype(np.int64), units.astype(np.int64)
    order = np.argsort(keys, kind="stable")
    keys, units = keys[order], units[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts], np.add.reduceat(units, starts)


def count_documents(
    documents: list[np.ndarray], vocab_size: int, window: int = 15
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique keys ``i * vocab_size + j`` and their units, for word-id documents."""
    scale = weight_scale(window)
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    if lengths.sum() == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.concatenate(documents).astype(np.int64)
    doc_of = np.repeat(np.arange(len(documents)), lengths)
    keys, units = [], []
    for d in range(1, window + 1):
        same_doc = doc_of[:-d] == doc_of[d:]
        left, right = ids[:-d][same_doc], ids[d:][same_doc]
        distinct = left != right
        left, right = left[distinct], right[distinct]
        keys += [left * vocab_size + right, right * vocab_size + left]
        units.append(np.full(2 * len(left), scale // d, dtype=np.int64))
    return _sum_duplicates(np.concatenate(keys), np.concatenate(units))


def _to_cooccurrence(keys: np.ndarray, units: np.ndarray, vocab_size: int, window: int) -> Cooccurrence:
    return Cooccurrence(vocab_size, window, keys // vocab_size, keys % vocab_size, units)


def count(documents: list[np.ndarray], vocab_size: int, window: int = 15) -> Cooccurrence:
    """Single-process count (the reference for ``count_parallel``)."""
    return _to_cooccurrence(*count_documents(documents, vocab_size, window), vocab_size, window)


def shard_bounds(lengths: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """Split documents into ``parts`` contiguous ranges of about equal token count."""
    ends = np.cumsum(lengths)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="left") + 1 if len(ends) else []
    edges = [0, *[int(c) for c in cuts], len(lengths)]
    edges = np.maximum.accumulate(np.minimum(edges, len(lengths)))
    return [(int(edges[r]), int(edges[r + 1])) for r in range(parts)]


def count_worker(comm: Communicator, ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int, window: int):
    """One rank of ``count_parallel``: count a shard, then reduce to rank 0 up a tree.

    Returns ``(keys, units)`` on rank 0 and None elsewhere.
    """
    lengths_np = lengths.numpy()
    offsets = np.r_[0, np.cumsum(lengths_np)]
    first, last = shard_bounds(lengths_np, comm.world_size)[comm.rank]
    ids_np = ids.numpy()
    shard = [ids_np[offsets[k] : offsets[k + 1]] for k in range(first, last)]
    keys, units = count_documents(shard, vocab_size, window)

    step = 1
    while step < comm.world_size:
        if comm.rank % (2 * step) == step:  # my turn to hand my partial counts down the tree
            send_rows(comm, torch.from_numpy(np.stack([keys, units], axis=1)), comm.rank - step)
            return None
        if comm.rank % (2 * step) == 0 and comm.rank + step < comm.world_size:
            theirs = recv_rows(comm, comm.rank + step, torch.int64, (2,)).numpy()
            keys, units = _sum_duplicates(np.r_[keys, theirs[:, 0]], np.r_[units, theirs[:, 1]])
        step *= 2
    return keys, units


def count_parallel(
    documents: list[np.ndarray], vocab_size: int, window: int = 15, workers: int = 2, timeout: float = 600.0
) -> Cooccurrence:
    """Count with ``workers`` processes (``md.launch``); equal to ``count`` bit for bit."""
    from ..launch import launch

    weight_scale(window)  # validate before starting processes
    lengths = torch.tensor([len(d) for d in documents], dtype=torch.int64)
    ids = (
        torch.from_numpy(np.concatenate(documents).astype(np.int64))
        if documents
        else torch.zeros(0, dtype=torch.int64)
    )
    outs = launch(count_worker, workers, args=(ids, lengths, vocab_size, window), timeout=timeout)
    return _to_cooccurrence(*outs[0], vocab_size, window)
