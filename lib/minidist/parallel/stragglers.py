"""Stragglers: one slow worker, and a step that does not wait for it.

Synchronous data parallelism is as fast as its slowest rank: every allreduce needs
every rank's gradient, so a rank that sleeps 200 ms holds all of them for 200 ms::

    rank 0  [fwd+bwd]......waiting......[allreduce][opt]
    rank 1  [fwd+bwd]......waiting......[allreduce][opt]
    rank 2  [--- sleep (straggler) ---][fwd+bwd][allreduce][opt]

"Drop the slowest" lets the step proceed with the gradients that arrived in time and
divides by *their* number -- the gradient of a smaller batch, still unbiased if who is
late is random. It needs someone who decides who was on time: an aggregator process
(``serve_deadline_aggregator``) with a ``DeadlinePolicy``:

    a round (step, bucket) closes when all n workers have pushed, or when at least
    ``min_workers`` have pushed and ``deadline_s`` has passed since the first push.

``DeadlinePolicy(min_workers=n-1, deadline_s=0)`` is "the first n-1 of n" (track 1's
backup workers, ``glove.trainers.param_server`` with ``backup=1``); a generous
deadline with ``min_workers=1`` waits for everyone unless someone is really late.

Protocol (``DeadlineAveraging`` is the workers' DDP comm hook). Every push is a
header ``(step, bucket, numel, dtype)`` and the gradient. The aggregator sums the
on-time pushes, divides by their count, and sends *every* worker (the late one too) a
reply header ``(step, bucket, contributors bitmask, count)`` and the average, so all
ranks apply the same update and stay identical. A push that arrives after its round
closed carries an old (step, bucket): it is read (the stream must stay in step) and
discarded -- it can never be added into a later round, because rounds are keyed by
(step, bucket), not by arrival. The late worker reads the reply that waits in its
mailbox and goes on. ``close()`` sends a stop header; the aggregator returns when
every worker has stopped. Everything has a timeout (``md.launch(timeout=...)``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from ..collectives.async_ops import stream_of
from ..comm import Communicator
from ..wire import DTYPES
from .inbox import Inbox

STOP = -1
_TAG = 12


@dataclass(frozen=True)
class SlowRank:
    """Injects a straggler: rank ``rank`` sleeps ``delay_s`` (+ uniform [0, jitter_s), drawn
    from ``seed`` and the step) before each step; other ranks do not sleep."""

    rank: int
    delay_s: float
    jitter_s: float = 0.0
    seed: int = 0

    def delay(self, rank: int, step: int) -> float:
        if rank != self.rank:
            return 0.0
        return self.delay_s + self.jitter_s * random.Random(self.seed * 1_000_003 + step).random()

    def sleep(self, rank: int, step: int) -> float:
        seconds = self.delay(rank, step)
        if seconds > 0:
            time.sleep(seconds)
        return seconds


@dataclass(frozen=True)
class DeadlinePolicy:
    """Close a round when all pushed, or when >= ``min_workers`` pushed and ``deadline_s``
    has passed since the first push of the round."""

    min_workers: int
    deadline_s: float = 0.0

    def __post_init__(self) -> None:
        if self.min_workers < 1 or not self.deadline_s >= 0:
            raise ValueError(f"need min_workers >= 1 and deadline_s >= 0, got {self}")


@dataclass
class AggregatorReport:
    """Rounds closed, pushes discarded as late, and per round (step, bucket, contributors)."""

    rounds: int = 0
    discarded: int = 0
    contributors: list[tuple[int, int, list[int]]] = field(default_factory=list)
    stats: object = None


class DeadlineAveraging:
    """Workers' DDP comm hook: push the bucket to ``aggregator``, pull the average of the
    on-time workers. ``contributors`` lists, per (step, bucket), the worker indices used."""

    def __init__(self, comm: Communicator, workers: list[int], aggregator: int) -> None:
        if comm.rank not in workers:
            raise ValueError(f"rank {comm.rank} is not a worker {workers}")
        self.comm, self.workers, self.aggregator = comm, list(workers), aggregator
        self.step = -1
        self.contributors: list[list[int]] = []
        self.closed = False

    def __call__(self, _group_comm, flat: torch.Tensor, bucket_index: int):
        if bucket_index == 0:
            self.step += 1
        step = self.step
        return stream_of(self.comm).submit(
            f"push/pull bucket {bucket_index} to the aggregator",
            lambda: self._push_pull(flat, bucket_index, step),
        )

    def _push_pull(self, flat: torch.Tensor, bucket: int, step: int) -> torch.Tensor:
        header = torch.tensor([step, bucket, flat.numel(), DTYPES.index(flat.dtype)])
        self.comm.send(header, self.aggregator, tag=_TAG)
        self.comm.send(flat, self.aggregator, tag=_TAG)
        reply = torch.empty(4, dtype=torch.int64)
        self.comm.recv(reply, self.aggregator, tag=_TAG)
        if reply[:2].tolist() != [step, bucket]:
            raise RuntimeError(
                f"rank {self.comm.rank}: reply for {reply[:2].tolist()}, expected {[step, bucket]}"
            )
        self.comm.recv(flat, self.aggregator, tag=_TAG)
        mask = int(reply[2])
        self.contributors.append([i for i in range(len(self.workers)) if mask >> i & 1])
        return flat

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.send(torch.tensor([STOP, 0, 0, 0]), self.aggregator, tag=_TAG)


def _read_push(comm: Communicator, src: int):
    header = torch.empty(4, dtype=torch.int64)
    comm.recv(header, src, tag=_TAG)
    step, bucket, numel, code = header.tolist()
    if step == STOP:
        return None
    return (step, bucket), comm.recv(torch.empty(numel, dtype=DTYPES[code]), src, tag=_TAG)


def serve_deadline_aggregator(
    comm: Communicator, workers: list[int], policy: DeadlinePolicy, timeout_s: float = 120.0
) -> AggregatorReport:
    """The aggregator loop (see the module docstring). Returns when every worker stopped;
    ``TimeoutError`` if no push arrives for ``timeout_s``."""
    n = len(workers)
    if policy.min_workers > n:
        raise ValueError(f"min_workers={policy.min_workers} > {n} workers: no round could close")
    inbox = Inbox(comm, workers, _read_push)
    report = AggregatorReport()
    open_rounds: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    first_push: dict[tuple[int, int], float] = {}
    last_closed = (-1, -1)
    running, sends = set(workers), []
    while running:
        now = time.monotonic()
        waits = [
            first_push[k] + policy.deadline_s - now
            for k, got in open_rounds.items()
            if len(got) >= policy.min_workers
        ]
        try:
            src, message = inbox.get(timeout=max(0.0, min(waits)) if waits else timeout_s)
        except TimeoutError:
            if not waits:  # nobody pushed for timeout_s: a worker is stuck or gone
                raise
            src = None  # a deadline passed: close that round below
        if src is not None:
            if message is None:
                running.discard(src)
            elif message[0] <= last_closed:  # a late push: its round is closed; never mixed into another
                report.discarded += 1
            else:
                key, grad = message
                open_rounds.setdefault(key, {})[workers.index(src)] = grad
                first_push.setdefault(key, time.monotonic())
        for key in sorted(open_rounds):
            got = open_rounds[key]
            late = time.monotonic() >= first_push[key] + policy.deadline_s
            if len(got) == n or (len(got) >= policy.min_workers and late):
                sends += _close_round(comm, workers, key, open_rounds.pop(key), report)
                last_closed = max(last_closed, key)
        sends = [work for work in sends if not work.is_completed()]
    for work in sends:
        work.wait(timeout_s)
    report.stats = comm.stats
    return report


def _close_round(
    comm: Communicator, workers, key, got: dict[int, torch.Tensor], report: AggregatorReport
) -> list:
    order = sorted(got)
    average = got[order[0]].clone()
    for i in order[1:]:
        average += got[i]
    average /= len(order)
    mask = sum(1 << i for i in order)
    reply = torch.tensor([key[0], key[1], mask, len(order)])
    report.rounds += 1
    report.contributors.append((key[0], key[1], order))
    return [
        work for w in workers for work in (comm.isend(reply, w, tag=_TAG), comm.isend(average, w, tag=_TAG))
    ]
