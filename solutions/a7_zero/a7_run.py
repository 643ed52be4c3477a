"""Helpers of assignment 7's notebook and public tests: models, runs on N ranks, one process.

Every run builds the same stack of blocks on every rank from a seed, trains it for a few AdamW
steps on rank-dependent rows of one batch, and reports what the tests compare with one process
training on the whole batch (``one_process``). Your ``zero`` module is imported inside the
worker processes only, afresh at every launch.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import minidist as md

DTYPE = torch.float64  # N ranks and one process differ by rounding only
ADAMW = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}


@dataclass(frozen=True)
class Setup:
    """A stack of blocks ``widths[0] -> hidden -> widths[1] -> ...`` trained on ``ranks`` ranks."""

    widths: tuple[int, ...] = (6, 5, 4)
    hidden: int = 7
    ranks: int = 2
    rows: int = 3  # rows of the batch per rank
    steps: int = 3
    seed: int = 0
    transport: str = "shm"
    dtype: torch.dtype = DTYPE


class Block(nn.Module):
    """Linear -> tanh -> Linear. ``holds()`` says whether its weights are materialised now."""

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.log: list | None = None  # the run's list: (event, blocks holding weights) per forward

    def holds(self) -> bool:
        return any(p.numel() > 0 and p.untyped_storage().nbytes() > 0 for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log is not None:
            self.log.append(self)
        return self.down(torch.tanh(self.up(x)))


def make_blocks(setup: Setup) -> list[Block]:
    torch.manual_seed(setup.seed)
    blocks = [Block(a, setup.hidden, b) for a, b in zip(setup.widths[:-1], setup.widths[1:])]
    return [b.to(setup.dtype) for b in blocks]


def batch(setup: Setup, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 17 * setup.seed + step)
    rows = setup.rows * setup.ranks
    x = torch.randn(rows, setup.widths[0], generator=g, dtype=setup.dtype)
    y = torch.randn(rows, setup.widths[-1], generator=g, dtype=setup.dtype)
    return x, y


def local(setup: Setup, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(setup, step)
    rows = slice(rank * setup.rows, (rank + 1) * setup.rows)
    return x[rows], y[rows]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def one_process(setup: Setup) -> list[torch.Tensor]:
    """The dense stack trained by torch's AdamW on the whole batch: every parameter, in order."""
    blocks = make_blocks(setup)
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, **ADAMW)
    for step in range(setup.steps):
        x, y = batch(setup, step)
        for b in blocks:
            x = b(x)
        opt.zero_grad()
        loss_of(x, y).backward()
        opt.step()
    return [p.detach().clone() for p in params]


def zero2_worker(comm, setup: Setup) -> dict:
    """ZeRO-2 on the dense stack: the parameters after training and the bytes sent while stepping."""
    zero = importlib.import_module("zero")
    blocks = make_blocks(setup)
    params = [p for b in blocks for p in b.parameters()]
    opt = zero.ShardedAdamW(params, comm, **ADAMW)
    sent, grads_left = 0, 0
    for step in range(setup.steps):
        x, y = local(setup, comm.rank, step)
        for b in blocks:
            x = b(x)
        loss_of(x, y).backward()
        before = comm.stats.bytes_sent
        opt.step()
        sent += comm.stats.bytes_sent - before
        grads_left += sum(p.grad is not None for p in params)
        opt.zero_grad()
    return {"params": [p.detach().clone() for p in params], "bytes": sent, "grads_left": grads_left}


def zero3_worker(comm, setup: Setup, prefetch: bool = True) -> dict:
    """ZeRO-3: the full parameters after training (gathered here), the blocks holding weights at
    every block's forward, and the bytes sent per step."""
    zero = importlib.import_module("zero")
    blocks = make_blocks(setup)
    stack = zero.ShardedStack(blocks, comm, prefetch=prefetch)
    opt = torch.optim.AdamW(stack.parameters(), **ADAMW)
    log: list = []
    held = []
    for b in blocks:
        b.log = log
    sent = []
    for step in range(setup.steps):
        x, y = local(setup, comm.rank, step)
        before = comm.stats.bytes_sent
        log.clear()
        out = stack(x)
        between = sum(b.holds() for b in blocks)
        loss_of(out, y).backward()
        held.append({"between": between, "after": sum(b.holds() for b in blocks), "forwards": len(log)})
        opt.step()
        opt.zero_grad()
        sent.append(comm.stats.bytes_sent - before)
    shards = [md.allgather(comm, s.detach()).view(-1) for s in stack.parameters()]
    return {"shards": shards, "held": held, "bytes": sent}


def zero3_params(setup: Setup, shards: list[torch.Tensor]) -> list[torch.Tensor]:
    """The dense parameters from the gathered shards (the layout of ``zero.py``'s docstring)."""
    out = []
    for b, rows in zip(make_blocks(setup), shards):
        offset = 0
        for p in b.parameters():
            out.append(rows[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
    return out


def padded(numel: int, world: int) -> int:
    return -(-numel // world) * world


class _Done:
    """A collective's handle that is already done: ``wait()`` gives its result."""

    def __init__(self, result) -> None:
        self.result = result

    def wait(self, timeout=None):
        return self.result

    def is_completed(self) -> bool:
        return True


def _at_once(collective):
    """``collective`` run at its call even with ``async_op=True`` (the profiler counts this thread only)."""

    def call(comm, tensor, *args, async_op: bool = False, **kwargs):
        result = collective(comm, tensor, *args, **kwargs)
        return _Done(result) if async_op else result

    return call


def peak_worker(comm, setup: Setup, prefetch: bool = False) -> dict:
    """Two training steps of ``ShardedStack`` under torch's profiler: the peak of the bytes allocated.

    As in the grader's measured run, every collective runs at its call (``async_op=True``
    included), so that a gathered unit counts from the moment its allgather is issued."""
    md.allgather, md.reduce_scatter = _at_once(md.allgather), _at_once(md.reduce_scatter)
    zero = importlib.import_module("zero")
    with _quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        blocks = make_blocks(setup)
        stack = zero.ShardedStack(blocks, comm, prefetch=prefetch)
        opt = torch.optim.AdamW(stack.parameters(), foreach=False, **ADAMW)
        del blocks
        x, y = local(setup, comm.rank, 0)
        with torch.profiler.record_function("train"):
            for _ in range(2):
                loss_of(stack(x), y).backward()
                opt.step()
                opt.zero_grad()
    psi = sum(shard.numel() * comm.world_size for shard in stack.parameters())
    return {"peak": peak_bytes(prof), "psi": psi}


@contextlib.contextmanager
def _quiet():
    """File descriptor 2 to /dev/null: the profiler prints a line to it when it starts and stops."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(prof) -> int:
    """The most bytes alive at once inside the "train" range, counting everything allocated since the
    profiler started (allocations matched to frees by address; earlier tensors freed do not count)."""
    start = end = None
    for event in prof.profiler.kineto_results.events():
        if event.name() == "train":
            start, end = event.start_ns(), event.end_ns()
    memory = []
    for node in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if node.name == "[memory]":
            fields = node.extra_fields
            memory.append((node.start_time_ns, int(fields.alloc_size), int(fields.ptr)))
    memory.sort()
    live: dict[int, int] = {}
    total = peak = 0
    for t, size, ptr in memory:
        if size > 0:
            live[ptr] = live.get(ptr, 0) + size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if start is not None and start <= t <= end:
            peak = max(peak, total)
    return peak


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def run(worker, setup: Setup, timeout: float = 60.0, **kwargs) -> list:
    ranks, transport = setup.ranks, setup.transport
    args = (setup,)
    return md.launch(worker, world_size=ranks, args=args, kwargs=kwargs, transport=transport, timeout=timeout)
