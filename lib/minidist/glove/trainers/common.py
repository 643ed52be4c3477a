"""What every trainer returns, and the bookkeeping they share."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm  # plain bars: no ipywidgets needed, and they work in worker processes

from ...comm import CommStats
from ..model import GloveConfig, Pairs, embeddings


@dataclass
class TrainResult:
    """The trained table plus what was measured while training.

    ``history`` has one (seconds since training started, mean loss of the epoch) per
    epoch; the loss of an epoch is the mean of ``f diff^2 / 2`` over the pairs as they
    were visited (as glove.c reports it), so trainers can be compared on one axis.
    """

    name: str
    table: torch.Tensor
    gradsq: torch.Tensor
    history: list[tuple[float, float]]
    pairs_trained: int  # pair updates applied (dropped gradients not counted)
    seconds: float  # training time, without starting processes
    workers: int = 1
    comm_bytes: int = 0  # payload bytes sent by all ranks together
    extra: dict = field(default_factory=dict)
    row_updates: int | None = None  # Hogwild: table-row updates made (2 per pair per epoch)
    lost_updates: int | None = None  # Hogwild with count_lost_updates=True: of those, lost to races

    @property
    def pairs_per_second(self) -> float:
        return self.pairs_trained / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_loss(self) -> float:
        return self.history[-1][1] if self.history else float("nan")

    def vectors(self) -> np.ndarray:
        return embeddings(self.table, self.table.shape[0] // 2)

    def __repr__(self) -> str:
        lost = (
            ""
            if self.lost_updates is None
            else f", {self.lost_updates:,} of {self.row_updates:,} row updates lost"
        )
        return (
            f"TrainResult({self.name}, {self.workers} worker(s): {self.pairs_per_second / 1e6:.2f}M pairs/s, "
            f"loss {self.final_loss:.4f}, {self.comm_bytes / 2**20:.1f} MiB sent{lost})"
        )


def batch_slices(start: int, stop: int, batch_size: int) -> Iterator[slice]:
    for first in range(start, stop, batch_size):
        yield slice(first, min(first + batch_size, stop))


def split(length: int, parts: int, part: int) -> slice:
    """The ``part``-th of ``parts`` contiguous, nearly equal pieces of range(length)."""
    return slice(length * part // parts, length * (part + 1) // parts)


def training_order(pairs: Pairs, config: GloveConfig) -> Pairs:
    """Every trainer visits the pairs in this one fixed shuffled order."""
    return pairs.shuffled(config.seed)


class Clock:
    """Seconds since training started (after the processes are up)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


def total_bytes(stats: list[CommStats]) -> int:
    return sum(s.bytes_sent for s in stats)


def epochs(count: int, desc: str, show: bool):
    """``range(count)``, with a progress bar when ``show``.

    tqdm's default lock is a multiprocessing semaphore; created inside a worker that
    leaves through ``os._exit`` it would be reported as leaked, so workers get a
    thread lock (their bars never share a terminal line anyway).
    """
    if not show:
        return range(count)
    tqdm.set_lock(threading.RLock())
    return tqdm(range(count), desc=desc)


def step_bar(total: int, desc: str, show: bool) -> tqdm:
    """A progress bar of ``total`` steps, silent unless ``show``.

    For loops that do not advance one by one (a parameter-server worker may skip
    steps the others closed without it): move it with ``bar.update(new_step - bar.n)``
    and ``close()`` it at the end, which draws its final state. The lock is a thread
    lock, as in ``epochs`` -- also for a silent bar, which tqdm registers under its lock too.
    """
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, unit="step", disable=not show)
