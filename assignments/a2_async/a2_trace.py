"""Helpers for the notebook and the public tests: toy data, runs of your code and their traces, pictures.

``async_ps`` (your file) is imported only inside the worker processes that ``md.launch``
starts, afresh at every launch: your latest edits are what runs, and an error in it is
reported, not raised at import here. You do not need to change this file.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch

import minidist as md
from minidist.glove.cooccur import count
from minidist.glove.model import GloveConfig, Pairs, batch_step, full_loss, init_gradsq, init_table
from minidist.glove.trainers.common import batch_slices

HERE = os.path.dirname(os.path.abspath(__file__))
TOY_CONFIG = GloveConfig(dim=8, lr=0.1, batch_size=16, epochs=5, seed=0)


def toy_pairs(seed: int = 0, vocab_size: int = 40, tokens: int = 800, window: int = 4) -> Pairs:
    """A tiny GloVe training set in a fixed shuffled order: random documents, no files.

    Word ``w`` is drawn with probability proportional to ``1 / (w + 1)`` (Zipf-like, as in
    real text), in documents of 50 tokens; the pairs are shuffled with ``seed``.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab_size + 1)
    ids = rng.choice(vocab_size, size=tokens, p=weights / weights.sum())
    documents = [ids[start : start + 50] for start in range(0, tokens, 50)]
    return Pairs.from_cooccurrence(count(documents, vocab_size, window)).shuffled(seed)


def initial_state(order: Pairs, config: GloveConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return init_table(order.vocab_size, config.dim, config.seed), init_gradsq(order.vocab_size, config.dim)


@dataclass
class Run:
    """What a training run produced: the table, AdaGrad's sums, and what was measured."""

    table: torch.Tensor
    gradsq: torch.Tensor
    losses: list[list[float]]  # per worker (or rank), the summed loss of each epoch
    staleness: list[int]  # one per applied push (parameter server only)
    seconds: float

    def loss(self, order: Pairs) -> float:
        """glove.c's cost: the mean ``f diff^2 / 2`` over all pairs, with the final table."""
        return full_loss(self.table, order)


def sequential(order: Pairs, config: GloveConfig = TOY_CONFIG) -> Run:
    """The single-process loop: the reference every parallel run is compared with."""
    table, gradsq = initial_state(order, config)
    start = time.perf_counter()
    losses = [
        sum(
            batch_step(table, gradsq, order.subset(b), config.lr)
            for b in batch_slices(0, len(order), config.batch_size)
        )
        for _ in range(config.epochs)
    ]
    return Run(table, gradsq, [losses], [], time.perf_counter() - start)


# --- your code, in worker processes ----------------------------------------------------------
def ps_rank(
    comm,
    order: Pairs,
    config: GloveConfig,
    compute_seconds: float = 0.0,
    staleness_aware: bool = True,
    worker: str = "ps_worker",
):
    """Rank 0 runs your ``run_server``, the other ranks your ``ps_worker`` (or ``worker``).

    Two knobs for the notebook's experiments, applied to your module in this process only:

    * ``compute_seconds``: every call of ``pair_gradients`` in your worker first sleeps that
      long. It stands in for the forward and backward pass of a model bigger than the toy's,
      which take milliseconds, not microseconds: long enough for the other workers to push
      while this one computes. (A sleep, unlike real computing, leaves the core free, so one
      server and several workers all make progress on two cores.)
    * ``staleness_aware=False``: your server's ``staleness_aware_lr`` is replaced by one that
      returns ``lr`` unchanged: plain asynchronous SGD, every push at the full rate.
    """
    async_ps = importlib.import_module("async_ps")
    if not staleness_aware:
        async_ps.staleness_aware_lr = _full_rate
    if compute_seconds > 0:
        async_ps.pair_gradients = _taking_time(async_ps.pair_gradients, compute_seconds)
    if comm.rank == 0:
        table, gradsq = initial_state(order, config)
        start = time.perf_counter()
        table, gradsq, staleness = async_ps.run_server(comm, table, gradsq, config)
        return table, gradsq, [int(s) for s in staleness], time.perf_counter() - start
    return getattr(async_ps, worker)(comm, order, config)


def _full_rate(lr: float, staleness: int) -> float:
    """Plain asynchronous SGD: the learning rate whatever the staleness."""
    return lr


def _taking_time(pair_gradients, seconds: float):
    """``pair_gradients`` that first spends ``seconds`` "computing" (see ``ps_rank``)."""

    def slower_pair_gradients(*args, **kwargs):
        time.sleep(seconds)
        return pair_gradients(*args, **kwargs)

    return slower_pair_gradients


def hogwild_rank(comm, order: Pairs, table: torch.Tensor, gradsq: torch.Tensor, config: GloveConfig):
    async_ps = importlib.import_module("async_ps")
    comm.barrier()
    start = time.perf_counter()
    losses = async_ps.hogwild_worker(comm, order, table, gradsq, config)
    return losses, time.perf_counter() - start


def parameter_server(
    order: Pairs,
    config: GloveConfig = TOY_CONFIG,
    workers: int = 3,
    timeout: float = 60,
    compute_seconds: float = 0.0,
    staleness_aware: bool = True,
    worker: str = "ps_worker",
) -> Run:
    """Your server on rank 0 and ``workers`` of your workers (md.launch errors propagate).

    ``compute_seconds``, ``staleness_aware`` and ``worker``: see ``ps_rank``.
    """
    outs = md.launch(
        ps_rank,
        workers + 1,
        args=(order, config, compute_seconds, staleness_aware, worker),
        timeout=timeout,
        threads_per_worker=1,
    )
    table, gradsq, staleness, seconds = outs[0]
    return Run(table, gradsq, outs[1:], staleness, seconds)


def hogwild(order: Pairs, config: GloveConfig = TOY_CONFIG, ranks: int = 2, timeout: float = 60) -> Run:
    """Your ``hogwild_worker`` on ``ranks`` ranks, all on one table in shared memory."""
    table, gradsq = (t.share_memory_() for t in initial_state(order, config))
    outs = md.launch(
        hogwild_rank, ranks, args=(order, table, gradsq, config), timeout=timeout, threads_per_worker=1
    )
    return Run(table.clone(), gradsq.clone(), [losses for losses, _ in outs], [], max(s for _, s in outs))


def try_run(function, *args, **kwargs) -> Run | None:
    """``function(*args)``, or None (and a note) while a part of it is not implemented yet."""
    try:
        return function(*args, **kwargs)
    except md.WorkerError as error:
        if error.exc_type != "NotImplementedError":
            raise
        print(f"not implemented yet ({error.summary}): nothing to show.")
        return None


# --- pictures --------------------------------------------------------------------------------
# --- task 4: a worker's time on the emulated clock (what the grader measures) --------------------
LINK_ALPHA, LINK_BANDWIDTH = 15e-6, 1.25e9  # the grader's link: seconds per message, bytes per second
PAIR_SECONDS = 10e-6  # the grader's emulated compute: seconds per pair of a batch


class SendLog(md.CommView):
    """Wraps a communicator; records what this rank sends, in order: ``(numel, first value)``."""

    def __init__(self, comm) -> None:
        super().__init__(comm)
        self.sent: list[tuple[int, float | None]] = []

    def _record(self, tensor: torch.Tensor) -> None:
        flat = tensor.reshape(-1)
        self.sent.append((flat.numel(), flat[0].item() if flat.numel() else None))

    def send(self, tensor, dst, tag=0):
        self._record(tensor)
        return self.inner.send(tensor, dst, tag)

    def isend(self, tensor, dst, tag=0):
        self._record(tensor)
        return self.inner.isend(tensor, dst, tag)


def timed_rank(comm, order: Pairs, config: GloveConfig, worker: str):
    """Rank 0 your ``run_server``; rank 1 your ``worker`` through a SendLog: what it sent."""
    async_ps = importlib.import_module("async_ps")
    if comm.rank == 0:
        table, gradsq = initial_state(order, config)
        async_ps.run_server(comm, table, gradsq, config)
        return None
    log = SendLog(comm)
    getattr(async_ps, worker)(log, order, config)
    return log.sent


def requests_of(sent: list[tuple[int, float | None]]) -> list[tuple[str, int]]:
    """The requests ``(kind, rows)`` in ``sent`` (``send_rows``: a length, then the rows)."""
    requests, i = [], 0
    while i < len(sent):
        length = int(sent[i][1])
        kind = {0: "pull", 1: "push"}.get(int(sent[i + 1][1]), "done")
        i += 2
        if kind == "push":  # then the gradients: a length, and the rows unless there are none
            i += 1 if int(sent[i][1]) == 0 else 2
        requests.append((kind, length - 2))
    return requests


def _cost(kind: str, rows: int, width: int) -> float:
    messages = 4 if kind == "push" else 2
    nbytes = (2 + rows) * 8 + (rows * width * 4 if kind == "push" else 0)
    return messages * LINK_ALPHA + nbytes / LINK_BANDWIDTH


def worker_time(order: Pairs, worker: str = "prefetching_worker", config: GloveConfig = TOY_CONFIG):
    """Your server and one of your ``worker``, timed as the grader times task 4: returns
    ``(emulated seconds, lower bound)``. The model (the grader's ``timing.py``): one outgoing link
    per rank, ``LINK_ALPHA`` per message plus the bytes over ``LINK_BANDWIDTH``; ``PAIR_SECONDS``
    of compute per pair, which starts once the batch's pull is answered and the previous batch is
    done; the server answers at once; the bound is ``max(total compute, the link's busy time for
    one pull per batch of its distinct rows and one push)``."""
    sent = md.launch(timed_rank, 2, args=(order, config, worker), timeout=60)[1]
    width = config.dim + 1
    batches = [
        order.subset(b) for _ in range(config.epochs) for b in batch_slices(0, len(order), config.batch_size)
    ]
    link = cpu = 0.0
    answers, pushes = [], 0
    for kind, rows in requests_of(sent):
        if kind == "push":
            cpu = max(cpu, answers[pushes]) + PAIR_SECONDS * len(batches[pushes])
            pushes += 1
        link = max(link, cpu) + _cost(kind, rows, width)
        if kind == "pull":  # the answer: rows (a length, then the rows), then the version
            answers.append(link + 3 * LINK_ALPHA + (rows * width * 4 + 16) / LINK_BANDWIDTH)
    busy = _cost("done", 0, width)
    for batch in batches:
        distinct = len(torch.unique(torch.cat([batch.rows, batch.cols])))
        busy += _cost("pull", distinct, width) + _cost("push", 2 * len(batch), width)
    return max(link, cpu), max(busy, PAIR_SECONDS * sum(len(b) for b in batches))


def draw_staleness(runs: dict[str, Run]):
    """One histogram of the staleness of the pushes per run."""
    fig, axes = plt.subplots(1, len(runs), figsize=(4 * len(runs), 3), squeeze=False)
    for ax, (name, run) in zip(axes[0], runs.items()):
        counts = np.bincount(np.asarray(run.staleness, dtype=np.int64))
        ax.bar(range(len(counts)), counts)
        ax.set_title(f"{name}: mean {np.mean(run.staleness):.2f}")
        ax.set_xlabel("staleness (pushes applied since the pull)")
    axes[0][0].set_ylabel("pushes")
    fig.tight_layout()
    return fig


def draw_losses(runs: dict[str, Run], pairs: int):
    """The mean loss per pair of each epoch, summed over the workers (as glove.c reports it)."""
    fig, ax = plt.subplots(figsize=(5, 3))
    for name, run in runs.items():
        per_epoch = np.sum(np.asarray(run.losses, dtype=np.float64), axis=0) / pairs
        ax.plot(range(1, len(per_epoch) + 1), per_epoch, marker="o", label=name)
    ax.set_xticks(range(1, len(per_epoch) + 1))
    ax.set_xlabel("epoch")
    ax.set_ylabel("mean loss while training")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    return fig


#: one public test per task: what the course's own CI runs from this notebook
#: (MINIDIST_PUBLIC_TESTS=one-per-task), where the whole file is run once by `make test`
ONE_PER_TASK = [
    "test_staleness_aware_lr",
    "test_one_worker_is_the_single_process_loop",
    "test_hogwild_one_rank_is_the_single_process_loop",
]


def run_public_tests(*pytest_args: str) -> bool:
    """Run test_a2_async.py in a fresh process (your latest code); print its report."""
    targets = ["test_a2_async.py"]
    if os.environ.get("MINIDIST_PUBLIC_TESTS") == "one-per-task" and not pytest_args:
        targets = [f"test_a2_async.py::{name}" for name in ONE_PER_TASK]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    result = subprocess.run([*command, *pytest_args], cwd=HERE, capture_output=True, text=True)
    print(result.stdout[-20_000:], result.stderr[-5_000:], sep="")
    return result.returncode == 0
