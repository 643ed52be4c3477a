"""Helpers for the assignment notebook: trace your collectives, draw them, run the tests.

``trace("ring_allreduce", world_size=4, numel=1000)`` runs your function from
``collectives.py`` on 4 ranks through a ``TracingComm``, a communicator that writes down
every message a rank sends before passing it on, and returns a ``Trace``. The drawing
functions turn traces into pictures. ``collectives`` is imported inside the worker
processes, afresh at every launch: your latest edits are what runs.

A rank's *step* ``k`` is the k-th message it sends. In a ring, and in a butterfly on a
power-of-two number of ranks, every rank sends exactly one message per step, so step
``k`` is the same moment on every rank.

**Values that say where they come from.** Element ``i`` of rank ``r``'s input is
``2**r + 256 * c``, where ``c`` is the chunk of element ``i`` (``p`` chunks as in
``chunk_offsets``). A partial sum over a set ``S`` of ranks is then
``sum(2**r for r in S) + 256 * c * len(S)``: from any value a message carries we can read
back which chunk it belongs to and whose contributions it already holds (up to 8 ranks).
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import torch

import minidist as md

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_ENCODED_RANKS = 8  # 2**rank must stay below 256


class TracingComm(md.CommView):
    """Wraps a communicator; records every send/isend of this rank as
    ``(dst, nbytes, first value, last value)`` (the values are None for an empty message).
    A view (``md.CommView``): every call it does not override goes to ``self.inner``."""

    def __init__(self, comm) -> None:
        super().__init__(comm)
        self.sent: list[tuple[int, int, float | None, float | None]] = []

    def _record(self, tensor: torch.Tensor, dst: int) -> None:
        flat = tensor.reshape(-1)
        first, last = (flat[0].item(), flat[-1].item()) if flat.numel() else (None, None)
        self.sent.append((int(dst), tensor.numel() * tensor.element_size(), first, last))

    def send(self, tensor, dst, tag=0):
        self._record(tensor, dst)
        return self.inner.send(tensor, dst, tag)

    def isend(self, tensor, dst, tag=0):
        self._record(tensor, dst)
        return self.inner.isend(tensor, dst, tag)


def star_allreduce(comm, tensor: torch.Tensor) -> None:
    """For comparison, the obvious allreduce: everyone sends to rank 0, which sends the sum back.

    Correct, and what the ring is designed to avoid: rank 0 sends and receives (p - 1) * n bytes.
    """
    if comm.rank != 0:
        comm.send(tensor, 0)
        comm.recv(tensor, 0)
        return
    incoming = torch.empty_like(tensor)
    for src in range(1, comm.world_size):
        comm.recv(incoming, src)
        tensor += incoming
    for dst in range(1, comm.world_size):
        comm.send(tensor, dst)


# --- inputs that can be decoded ------------------------------------------------------------------
def rank_input(rank: int, world_size: int, numel: int) -> torch.Tensor:
    """``2**rank + 256 * chunk`` per element (see the module docstring); float32."""
    base, extra = divmod(numel, world_size)
    sizes = [base + (1 if i < extra else 0) for i in range(world_size)]
    chunk = torch.repeat_interleave(torch.arange(world_size), torch.tensor(sizes))
    return (2.0**rank + 256.0 * chunk).to(torch.float32)


def decode(value: float) -> tuple[int, list[int]]:
    """(chunk, ranks whose contributions the value holds) of a value built from rank_input."""
    whole = int(round(value))
    mask = whole % 256
    ranks = [r for r in range(MAX_ENCODED_RANKS) if mask >> r & 1]
    return (whole // 256) // max(len(ranks), 1), ranks


@dataclass
class Trace:
    function: str
    world_size: int
    numel: int
    sent: list[list[tuple]] = field(default_factory=list)  # sent[rank] = [(dst, nbytes, first, last)]
    correct: bool = True

    @property
    def nbytes(self) -> int:
        """Size of one rank's input in bytes (float32)."""
        return 4 * self.numel

    def bytes_per_rank(self) -> list[int]:
        return [sum(message[1] for message in messages) for messages in self.sent]

    def steps(self) -> int:
        return max((len(messages) for messages in self.sent), default=0)

    def label(self, message: tuple, short: bool = False) -> str:
        """What a message carries, e.g. "chunk 2: 0+3" (a partial sum of ranks 0 and 3).

        ``short``: "all" instead of listing every rank, for complete sums.
        """
        _, nbytes, first, last = message
        if first is None or self.world_size > MAX_ENCODED_RANKS:
            return f"{nbytes} B"
        (chunk_first, ranks), (chunk_last, _) = decode(first), decode(last)
        chunks = f"chunk {chunk_first}" if chunk_first == chunk_last else f"chunks {chunk_first}-{chunk_last}"
        whose = "all" if short and len(ranks) == self.world_size else "+".join(str(r) for r in ranks)
        return f"{chunks}: {whose}"


def trace_worker(comm, function: str, numel: int, src: int = 0) -> tuple[list, torch.Tensor]:
    """Run ``function`` through a TracingComm on ``rank_input``; return (messages sent, result)."""
    tracer = TracingComm(comm)
    x = rank_input(comm.rank, comm.world_size, numel)
    if function == "star_allreduce":
        star_allreduce(tracer, x)
        return tracer.sent, x
    fn = getattr(importlib.import_module("collectives"), function)
    if function == "tree_broadcast":
        fn(tracer, x, src)
        return tracer.sent, x
    if function.endswith("allreduce"):
        fn(tracer, x)
        return tracer.sent, x
    return tracer.sent, fn(tracer, x)


def expected_result(function: str, world_size: int, numel: int, src: int, rank: int) -> torch.Tensor:
    inputs = [rank_input(r, world_size, numel) for r in range(world_size)]
    if function == "tree_broadcast":
        return inputs[src]
    if function == "ring_allgather":
        return torch.stack(inputs)
    total = sum(inputs)
    if function == "ring_reduce_scatter":
        block = numel // world_size
        return total[rank * block : (rank + 1) * block]
    return total


def trace(function: str, world_size: int, numel: int, src: int = 0) -> Trace | None:
    """Run and trace ``collectives.<function>``; None (and a note) if it is not implemented yet."""
    try:
        outs = md.launch(trace_worker, world_size, args=(function, numel, src), timeout=30)
    except md.WorkerError as error:
        if error.exc_type != "NotImplementedError":
            raise
        print(f"{function} is not implemented yet ({error.summary}): nothing to trace.")
        return None
    result = Trace(function, world_size, numel, [sent for sent, _ in outs])
    for rank, (_, got) in enumerate(outs):
        want = expected_result(function, world_size, numel, src, rank)
        if not (isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)):
            result.correct = False
            print(f"{function} on {world_size} ranks: rank {rank} got a wrong result")
    return result


def budget(function: str, world_size: int, numel: int, element_size: int = 4) -> list[int]:
    """An upper bound on the bytes each rank sends in ``function``, from the formulas of section 1.

    The grader is stricter: each rank's messages and bytes must *equal* what the algorithm
    sends (``test_every_rank_sends_exactly_what_the_algorithm_sends``); this bound only tells a
    far-off algorithm from a plausible one. ``star_allreduce`` gets the ring's budget: it is the
    allreduce the budget is there to catch.
    """
    p, n = world_size, numel * element_size
    if function in ("ring_allreduce", "star_allreduce"):
        return [2 * (p - 1) * math.ceil(numel / p) * element_size] * p
    if function == "butterfly_allreduce":
        p2 = 1 << (p.bit_length() - 1)
        halving_doubling = 2 * (p2 - 1) * math.ceil(numel / p2) * element_size
        return [halving_doubling + (n if rank < 2 * (p - p2) else 0) for rank in range(p)]
    if function == "ring_allgather":
        return [(p - 1) * n] * p
    if function == "ring_reduce_scatter":
        return [(p - 1) * n // p] * p
    if function == "tree_broadcast":
        return [math.ceil(math.log2(p)) * n] * p
    raise ValueError(f"no budget for {function!r}")


def report_budget(traces: list[Trace]) -> None:
    """Print, per trace, the rank furthest over (or least under) its upper bound of bytes."""
    for trace in traces:
        sent = trace.bytes_per_rank()
        limits = budget(trace.function, trace.world_size, trace.numel)
        worst = max(range(trace.world_size), key=lambda rank: sent[rank] - limits[rank])
        verdict = "within budget" if sent[worst] <= limits[worst] else "OVER BUDGET"
        print(
            f"{trace.function:>20} on {trace.world_size} ranks: rank {worst} sent {sent[worst]:>6} B, "
            f"budget {limits[worst]:>6} B -> {verdict}"
        )


# --- task 6: time the messages on an emulated link ----------------------------------------------
LINK_ALPHA, LINK_BANDWIDTH = 15e-6, 1.25e9  # the grader's link (collectives.LINK_ALPHA, LINK_BANDWIDTH)
MEASURED_SIZES = (256, 4096, 32768, 131072, 1048576)  # bytes per rank, the grader's sweep


class _RecordedWait:
    """An ``irecv``'s handle that writes the receive down when it completes (``wait``)."""

    def __init__(self, handle, record) -> None:
        self.handle, self.record, self.done = handle, record, False

    def wait(self, timeout: float | None = None):
        out = self.handle.wait(timeout)
        if not self.done:
            self.done = True
            self.record()
        return out

    def is_completed(self) -> bool:
        return self.handle.is_completed()


class EventComm(md.CommView):
    """Wraps a communicator; records this rank's messages in order: ``("send", dst, tag, nbytes)``
    when a send or isend is posted, ``("recv", src, tag)`` when a receive completes."""

    def __init__(self, comm) -> None:
        super().__init__(comm)
        self.events: list[tuple] = []

    def send(self, tensor, dst, tag=0):
        self.events.append(("send", int(dst), tag, tensor.numel() * tensor.element_size()))
        return self.inner.send(tensor, dst, tag)

    def isend(self, tensor, dst, tag=0):
        self.events.append(("send", int(dst), tag, tensor.numel() * tensor.element_size()))
        return self.inner.isend(tensor, dst, tag)

    def recv(self, tensor, src, tag=0):
        out = self.inner.recv(tensor, src, tag)
        self.events.append(("recv", int(src), tag))
        return out

    def irecv(self, tensor, src, tag=0):
        handle = self.inner.irecv(tensor, src, tag)
        return _RecordedWait(handle, lambda: self.events.append(("recv", int(src), tag)))


def event_worker(comm, function: str, numels: list[int]) -> list[list[tuple]]:
    """Run ``collectives.<function>`` once per size through an EventComm; its events per call."""
    fn = getattr(importlib.import_module("collectives"), function)
    calls = []
    for numel in numels:
        recorder = EventComm(comm)
        fn(recorder, torch.ones(numel))
        calls.append(recorder.events)
    return calls


def link_seconds(
    events: list[list[tuple]], alpha: float = LINK_ALPHA, bandwidth: float = LINK_BANDWIDTH
) -> float:
    """Replay every rank's events on the link model of lecture 2, section 4: one outgoing link per
    rank whose messages leave one after another, each taking ``alpha + bytes / bandwidth``; a
    receive ends when its message is delivered; compute is free. The grader times your messages so."""
    p = len(events)
    now, link, position = [0.0] * p, [0.0] * p, [0] * p
    delivered: dict[tuple, list[float]] = {}
    taken: dict[tuple, int] = {}
    while any(position[r] < len(events[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while position[r] < len(events[r]):
                event = events[r][position[r]]
                if event[0] == "send":
                    _, dst, tag, nbytes = event
                    link[r] = max(link[r], now[r]) + alpha + nbytes / bandwidth
                    delivered.setdefault((r, dst, tag), []).append(link[r])
                else:
                    key = (event[1], r, event[2])
                    k = taken.get(key, 0)
                    if k >= len(delivered.get(key, [])):
                        break  # not sent yet
                    now[r], taken[key] = max(now[r], delivered[key][k]), k + 1
                position[r] += 1
                progress = True
        if not progress:
            raise RuntimeError("a receive that no send matches")
    return max(max(now), max(link))


def time_on_the_link(function: str, world_size: int, sizes=MEASURED_SIZES) -> list[float]:
    """Emulated seconds of ``collectives.<function>`` on float32 tensors of ``sizes`` bytes per rank."""
    outs = md.launch(event_worker, world_size, args=(function, [size // 4 for size in sizes]), timeout=60)
    return [link_seconds([calls[k] for calls in outs]) for k in range(len(sizes))]


# --- pictures ------------------------------------------------------------------------------------
def _positions(world_size: int) -> np.ndarray:
    """Ranks on a circle, rank 0 at the top, clockwise."""
    angles = np.pi / 2 - 2 * np.pi * np.arange(world_size) / world_size
    return np.stack([np.cos(angles), np.sin(angles)], axis=1)


def draw_ring_steps(trace: Trace, columns: int = 3):
    """One panel per step: the ranks on a circle, an arrow per message, labelled with what it carries."""
    steps = trace.steps()
    rows = max(1, -(-steps // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.2 * rows), squeeze=False)
    xy = _positions(trace.world_size)
    for step, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if step >= steps:
            continue
        ax.set(xlim=(-1.6, 1.6), ylim=(-1.6, 1.6), aspect="equal")
        ax.set_title(f"step {step}", fontsize=10)
        for rank, (x, y) in enumerate(xy):
            ax.add_patch(plt.Circle((x, y), 0.2, color="C0", zorder=2))
            ax.text(x, y, str(rank), ha="center", va="center", color="white", zorder=3, fontsize=11)
        for rank, messages in enumerate(trace.sent):
            if step >= len(messages):
                continue
            dst = messages[step][0]
            start, end = xy[rank], xy[dst]
            direction = (end - start) / np.linalg.norm(end - start)
            ax.annotate(
                "",
                xy=end - 0.24 * direction,
                xytext=start + 0.24 * direction,
                arrowprops={"arrowstyle": "->", "color": "C3", "lw": 1.5},
            )
            outwards = np.array([-direction[1], direction[0]])  # left of a clockwise arrow
            middle = (start + end) / 2 + 0.32 * outwards
            label = trace.label(messages[step], short=True).replace(": ", "\n")
            ax.text(*middle, label, ha="center", va="center", fontsize=8, color="C3")
    fig.suptitle(f"{trace.function}, {trace.world_size} ranks, {trace.nbytes} bytes per rank")
    fig.tight_layout()
    return fig


def draw_step_heatmaps(traces: list[Trace]):
    """For each trace, a (step x rank) map of the bytes each rank sends, with the destination."""
    fig, axes = plt.subplots(1, len(traces), figsize=(4.2 * len(traces), 4.6), squeeze=False)
    vmax = max(message[1] for t in traces for messages in t.sent for message in messages)
    for ax, trace in zip(axes.flat, traces):
        grid = np.full((trace.steps(), trace.world_size), np.nan)
        for rank, messages in enumerate(trace.sent):
            for step, (dst, nbytes, *_) in enumerate(messages):
                grid[step, rank] = nbytes
                color = "white" if nbytes > vmax / 2 else "black"
                ax.text(rank, step, f"->{dst}", ha="center", va="center", fontsize=7, color=color)
        most = max(trace.bytes_per_rank())
        image = ax.imshow(grid, cmap="Oranges", vmin=0, vmax=vmax, aspect="auto")
        ax.set(
            xlabel="rank",
            ylabel="step",
            xticks=range(trace.world_size),
            title=f"{trace.function}\n{trace.steps()} steps, at most {most} B per rank",
        )
    fig.colorbar(image, ax=axes.ravel().tolist(), label="bytes sent in this step")
    return fig


def draw_traffic(traces: list[Trace]):
    """For each trace, a (sender x receiver) map of the bytes sent in all."""
    fig, axes = plt.subplots(1, len(traces), figsize=(3.6 * len(traces), 3.6), squeeze=False)
    for ax, trace in zip(axes.flat, traces):
        matrix = np.zeros((trace.world_size, trace.world_size))
        for rank, messages in enumerate(trace.sent):
            for dst, nbytes, *_ in messages:
                matrix[rank, dst] += nbytes
        top = matrix.max() / trace.nbytes
        ax.imshow(matrix / trace.nbytes, cmap="Blues", vmin=0)
        ax.set(
            xlabel="to rank",
            ylabel="from rank",
            xticks=range(trace.world_size),
            yticks=range(trace.world_size),
            title=f"{trace.function}, {trace.world_size} ranks",
        )
        for (src, dst), value in np.ndenumerate(matrix / trace.nbytes):
            if value:
                color = "white" if value > top / 2 else "black"
                ax.text(dst, src, f"{value:.3g}", ha="center", va="center", fontsize=7, color=color)
    fig.suptitle("bytes sent from rank to rank, in units of n (one rank's tensor)")
    fig.tight_layout()
    return fig


# --- the public tests -----------------------------------------------------------------------------
#: one public test per task: what the course's own CI runs from this notebook
#: (MINIDIST_PUBLIC_TESTS=one-per-task), where the whole file is run once by `make test`
ONE_PER_TASK = [
    "test_tree_broadcast[3]",
    "test_ring_allgather[3]",
    "test_ring_reduce_scatter[3]",
    "test_allreduce[3-ring_allreduce]",
    "test_allreduce[3-butterfly_allreduce]",
    "test_allreduce[3-fast_allreduce]",
]


def run_public_tests(*pytest_args: str) -> bool:
    """Run test_a1_collectives.py in a fresh process (your latest code); print its report."""
    targets = ["test_a1_collectives.py"]
    if os.environ.get("MINIDIST_PUBLIC_TESTS") == "one-per-task" and not pytest_args:
        targets = [f"test_a1_collectives.py::{name}" for name in ONE_PER_TASK]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    result = subprocess.run([*command, *pytest_args], cwd=HERE, capture_output=True, text=True)
    print(result.stdout[-20_000:], result.stderr[-5_000:], sep="")
    return result.returncode == 0
