"""The alpha-beta(-gamma) cost model of collectives.

Sending n bytes costs ``alpha + n * beta`` (latency plus size over bandwidth);
reducing n bytes costs ``n * gamma``. Counting, per algorithm, the messages
on the critical path and the bytes in them predicts its time (p ranks)::

    star       2 (p-1) (alpha + n beta) + (p-1) n gamma          the root does everything
    tree       2 L (alpha + n beta) + L n gamma,  L = ceil(log2 p)
    ring       2 (p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    butterfly  2 log2(q) alpha + 2 (q-1)/q n beta + (q-1)/q n gamma
               (+ 2 (alpha + n beta) + n gamma when p is not a power of two q)

    all_to_all (p-1) (alpha + n/p beta)     pairwise exchange; n = this rank's whole input
               (the list form with sizes exchanged: + (p-1) (alpha + 8 beta))

Small messages: latency terms dominate, few rounds win (tree, butterfly).
Large messages: bandwidth terms dominate, few bytes win (ring, butterfly). The
*crossover* sizes, where the best algorithm changes, follow from the model;
``crossovers`` finds them. The model only computes: measurements come in as
arguments. ``minidist.bench.p2p.measure_alpha_beta(transport)`` runs a ping-pong
on this machine and fits alpha and beta with ``fit_alpha_beta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("star", "tree", "ring", "butterfly")


@dataclass(frozen=True)
class AlphaBeta:
    alpha: float  # seconds per message
    beta: float  # seconds per byte sent
    gamma: float = 5e-11  # seconds per byte reduced (about 20 GB/s of float adds, one core)


# Rough values measured on the course machine (2 cores); bench.p2p.measure_alpha_beta gives yours.
DEFAULTS = {
    "shm": AlphaBeta(alpha=2.5e-6, beta=1 / 18e9),
    "pipe": AlphaBeta(alpha=45e-6, beta=1 / 4e9),
    "torch": AlphaBeta(alpha=90e-6, beta=1 / 4.5e9),
}


def predict(algorithm: str, p: int, nbytes: float, model: AlphaBeta) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` on ``p`` ranks (or, with
    ``algorithm="all_to_all"``, an all-to-all of ``nbytes`` per rank: p pieces of n/p)."""
    a, b, g = model.alpha, model.beta, model.gamma
    n = float(nbytes)
    if p == 1:
        return 0.0
    if algorithm == "all_to_all":
        return (p - 1) * (a + n / p * b)
    if algorithm == "star":
        return 2 * (p - 1) * (a + n * b) + (p - 1) * n * g
    if algorithm == "tree":
        levels = math.ceil(math.log2(p))
        return 2 * levels * (a + n * b) + levels * n * g
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    if algorithm == "butterfly":
        q = 1 << (p.bit_length() - 1)
        t = 2 * math.log2(q) * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g
        if q != p:
            t += 2 * (a + n * b) + n * g
        return t
    raise ValueError(f"no cost formula for {algorithm!r}; choose one of {ALGORITHMS} or 'all_to_all'")


def fastest_allreduce(p: int, nbytes: float, model: AlphaBeta | None = None) -> str:
    model = model or DEFAULTS["torch"]
    return min(ALGORITHMS, key=lambda algorithm: predict(algorithm, p, nbytes, model))


def crossovers(p: int, model: AlphaBeta, sizes) -> list[tuple[int, str, str]]:
    """(size, previous best, new best) wherever the predicted best algorithm changes."""
    changes, best = [], None
    for size in sizes:
        now = fastest_allreduce(p, size, model)
        if best is not None and now != best:
            changes.append((int(size), best, now))
        best = now
    return changes


def bytes_sent(algorithm: str, p: int, rank: int, numel: int, itemsize: int) -> int:
    """Exact payload bytes rank ``rank`` sends in one allreduce of ``numel`` elements.

    The textbook formulas (ring: 2(p-1)/p n) hold up to the rounding of n/p to
    whole elements; this function follows the implementation's chunking exactly.
    ``"all_to_all"`` (``numel``: the whole (p, *chunk) input): (p-1)/p of it, exactly.
    """
    n = numel * itemsize
    if p == 1:
        return 0
    if algorithm == "all_to_all":
        if numel % p:
            raise ValueError(f"an all_to_all input has p={p} equal rows; numel={numel} is not divisible by p")
        return (p - 1) * (numel // p) * itemsize
    if algorithm == "star":
        return (p - 1) * n if rank == 0 else n
    if algorithm == "tree":
        return n * (tree_sends(p, rank, reduce=True) + tree_sends(p, rank, reduce=False))
    if algorithm == "ring":
        from .ops import chunk_bounds

        sizes = [hi - lo for lo, hi in chunk_bounds(numel, p)]
        reduce_scatter = sum(sizes[(rank - s - 1) % p] for s in range(p - 1))
        allgather = sum(sizes[(rank - s) % p] for s in range(p - 1))
        return (reduce_scatter + allgather) * itemsize
    if algorithm == "butterfly":
        q = 1 << (p.bit_length() - 1)
        extra = p - q
        if rank < 2 * extra and rank % 2 == 0:
            return n  # hands its vector over and waits
        vrank = rank // 2 if rank < 2 * extra else rank - extra
        lo, hi, total = 0, numel, 0
        distance = q // 2
        while distance >= 1:
            mid = lo + (hi - lo) // 2
            keep, give = ((mid, hi), (lo, mid)) if vrank & distance else ((lo, mid), (mid, hi))
            total += (give[1] - give[0]) + (keep[1] - keep[0])  # halving gives, doubling returns
            lo, hi = keep
            distance //= 2
        return total * itemsize + (n if rank < 2 * extra else 0)
    raise ValueError(f"no byte formula for {algorithm!r}")


def all_to_all_split_bytes(send_rows, rank: int, row_bytes: int, sizes_given: bool = False) -> int:
    """Payload bytes rank ``rank`` sends in the list form of all_to_all: every piece but its
    own (``send_rows[j]`` rows of ``row_bytes`` bytes to rank j), plus one int64 count to
    each other rank unless the receivers were given the sizes (``recv_sizes=``)."""
    p = len(send_rows)
    data = sum(rows for j, rows in enumerate(send_rows) if j != rank) * row_bytes
    return data + (0 if sizes_given else 8 * (p - 1))


def tree_sends(p: int, rank: int, reduce: bool, root: int = 0) -> int:
    """Messages rank sends in a binomial reduce (1, except the root) or broadcast (its children)."""
    vrank = (rank - root) % p
    if reduce:
        return 0 if vrank == 0 else 1
    children, mask = 0, 1
    while mask < p and not vrank & mask:
        if vrank + mask < p:
            children += 1
        mask <<= 1
    return children


def fit_alpha_beta(nbytes, seconds) -> tuple[float, float]:
    """Least squares for t = alpha + n beta, in relative error (each point weighted 1/t)."""
    n = np.asarray(nbytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    rows = np.stack([1 / t, n / t], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(rows, np.ones_like(t), rcond=None)
    return float(alpha), float(beta)


def __getattr__(name: str):
    """``cost_model.measure`` moved: a lower layer must not start processes or benchmarks."""
    if name == "measure":
        raise AttributeError(
            "cost_model.measure(transport) is now minidist.bench.p2p.measure_alpha_beta(transport): "
            "the cost model takes measurements as arguments, and measuring lives in minidist.bench"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
