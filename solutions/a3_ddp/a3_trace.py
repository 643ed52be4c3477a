"""Helpers of assignment 3: models, one training run on p ranks and in one process, a timeline.

The notebook and the public tests use these; you do not need to change them. Worker functions
live here, in an importable module, because ``md.launch`` starts fresh processes that import
the function they run (a function defined in a notebook cannot be found there). Your ``ddp``
module is imported inside those processes only, afresh at every launch, so an edit of
``ddp.py`` counts at the next run.
"""

from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import minidist as md
from minidist import trace

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Setup:
    """One training run: which model, how many ranks, how the batch and the buckets are cut.

    Rank ``r`` trains on rows ``[r * local_batch, (r + 1) * local_batch)`` of every global
    batch; one process trains on all ``ranks * local_batch`` rows. ``accumulate`` micro-batches
    per step, all but the last inside ``no_sync``.
    """

    model: str = "mlp"  # "mlp": 8 -> width -> ... -> 4; "lm": tied embeddings, a frozen and an unused layer
    ranks: int = 2
    transport: str = "shm"
    local_batch: int = 4
    steps: int = 3
    accumulate: int = 1
    bucket_mb: float = 0.004
    find_unused: bool = False
    width: int = 24
    depth: int = 3
    seed: int = 0
    dtype: str = "float64"  # double: p ranks and one process then differ by rounding only


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        sizes = [8] + [width] * depth + [4]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


class TinyLM(nn.Module):
    """Tokens -> embedding -> a frozen projection -> tanh(linear) -> logits through the same
    embedding matrix (tied). ``spare`` is never called: an unused parameter."""

    def __init__(self, vocab: int = 20, dim: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.frozen = nn.Linear(dim, dim, bias=False).requires_grad_(False)
        self.spare = nn.Linear(dim, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        return self.head(torch.tanh(self.mix(h + self.frozen(h))))


def make_model(setup: Setup, rank: int = 0) -> nn.Module:
    """The setup's model; ranks other than 0 start from other weights (DDP broadcasts rank 0's)."""
    torch.manual_seed(setup.seed + 1000 * rank)
    model = MLP(setup.width, setup.depth) if setup.model == "mlp" else TinyLM()
    return model.to(getattr(torch, setup.dtype))


def global_batch(setup: Setup, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = setup.ranks * setup.local_batch
    g = torch.Generator().manual_seed(setup.seed * 7 + 100 * step + micro)
    if setup.model == "lm":
        return torch.randint(0, 20, (rows, 6), generator=g), torch.randint(0, 20, (rows, 6), generator=g)
    dtype = getattr(torch, setup.dtype)
    return torch.randn(rows, 8, generator=g, dtype=dtype), torch.randn(rows, 4, generator=g, dtype=dtype)


def loss_of(setup: Setup, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if setup.model == "lm":
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def grads_of(model: nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


# --- one process: the reference --------------------------------------------------------------
def one_process(setup: Setup) -> dict:
    """Train on the whole batch in one process: {"grads": after the first backward(s), "params"}."""
    model = make_model(setup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    first = None
    for step in range(setup.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(setup.accumulate):
            inputs, target = global_batch(setup, step, micro)
            loss_of(setup, model(inputs), target).backward()
        if step == 0:
            first = grads_of(model)
        optimizer.step()
    return {"grads": first, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


# --- p ranks: your DDP -------------------------------------------------------------------------
class AllreduceCounter:
    """Counts the calls of ``md.allreduce`` in this process (the wrapper is installed once)."""

    calls: list[tuple[int, int, int]] = []  # (step, micro, numel)
    where: tuple[int, int] = (-1, -1)

    @classmethod
    def install(cls) -> None:
        if getattr(md.allreduce, "counted", False):
            return
        original = md.allreduce

        @functools.wraps(original)
        def allreduce(comm, tensor, *args, **kwargs):
            cls.calls.append((*cls.where, tensor.numel()))
            return original(comm, tensor, *args, **kwargs)

        allreduce.counted = True
        md.allreduce = allreduce


def ddp_rank(comm, setup: Setup, record: bool = False) -> dict:
    """One rank: train with your ``BucketedDDP``; report gradients, parameters, allreduce calls
    and, with ``record``, the trace events (forward, backward until its last gradient, the wait
    for the buckets, the optimizer step, and your DDP's bucket spans)."""
    AllreduceCounter.install()
    ddp = importlib.import_module("ddp")
    model = make_model(setup, comm.rank)
    recorder = trace.Recorder(rank=comm.rank) if record else None
    last_ready = [0]

    def note(_param) -> None:  # runs before your hook: registered first
        last_ready[0] = time.perf_counter_ns()

    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(note)
    wrapped = ddp.BucketedDDP(model, comm, setup.bucket_mb, setup.find_unused, recorder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    first = None
    lo = comm.rank * setup.local_batch
    for step in range(setup.steps):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(setup.accumulate):
            AllreduceCounter.where = (step, micro)
            inputs, target = (t[lo : lo + setup.local_batch] for t in global_batch(setup, step, micro))
            sync = micro == setup.accumulate - 1
            with wrapped.no_sync() if not sync else _Nothing():
                start = time.perf_counter_ns()
                loss = loss_of(setup, wrapped(inputs), target)
                forward_end = time.perf_counter_ns()
                loss.backward()
                end = time.perf_counter_ns()
            if recorder is not None:
                _add(recorder, "forward", start, forward_end)
                _add(recorder, "backward", forward_end, last_ready[0])
                _add(recorder, "wait for buckets", last_ready[0], end)
        AllreduceCounter.where = (-1, -1)
        if step == 0:
            first = grads_of(model)
        if recorder is not None:
            with recorder.span("optimizer step", cat="optimizer"):
                optimizer.step()
        else:
            optimizer.step()
    return {
        "grads": first,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buckets": wrapped.buckets,
        "calls": list(AllreduceCounter.calls),
        "events": recorder.events if recorder is not None else [],
    }


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _add(recorder: trace.Recorder, name: str, start_ns: int, end_ns: int) -> None:
    """A compute span measured by hand (its end is seen in a hook, not at the end of a block)."""
    recorder.events.append(
        {
            "name": name,
            "cat": "compute",
            "rank": recorder.rank,
            "tid": 0,
            "ts_us": start_ns / 1000,
            "dur_us": max(end_ns - start_ns, 0) / 1000,
            "args": {"thread": "MainThread"},
        }
    )


def after_first_step(events: list[dict]) -> list[dict]:
    """The events of every rank from the end of its first optimizer step on (a warm-up step:
    threads start, memory is touched for the first time)."""
    kept = []
    for rank in sorted({e["rank"] for e in events}):
        mine = [e for e in events if e["rank"] == rank]
        steps = sorted(e["ts_us"] + e["dur_us"] for e in mine if e["cat"] == "optimizer")
        start = steps[0] if steps else float("-inf")
        kept.extend(e for e in mine if e["ts_us"] >= start)
    return kept


# --- task 4: the measured test's model, and its step on the emulated clock ---------------------
#: the grader's timed model: 12 blocks of width 64 (147 tensors, 620,352 parameters, float32) on
#: 524,288 tokens per GPU and step; a V100 at 40% of its peak; a 1 Gbit/s link, alpha = 50 us
TIMED = {"blocks": 12, "width": 64, "vocab": 256, "tokens": 524_288, "flops_per_s": 50e12}
ALPHA_S, BANDWIDTH_BPS = 50e-6, 125e6


def timed_layout() -> list[tuple[int, float]]:
    """(elements, forward FLOPs) of each parameter tensor in registration order: an input
    embedding (a lookup), blocks of attention and MLP matrices (2 N T FLOPs forward) with their
    biases and LayerNorms (none), an output matrix and its bias."""
    d, tokens = TIMED["width"], TIMED["tokens"]
    shapes = [(TIMED["vocab"] * d, False)]
    block = [(3 * d * d, True), (3 * d, False), (d * d, True), (d, False), (d, False), (d, False)]
    block += [(4 * d * d, True), (4 * d, False), (4 * d * d, True), (d, False), (d, False), (d, False)]
    shapes += block * TIMED["blocks"] + [(d * d, True), (d, False)]
    return [(numel, 2.0 * numel * tokens if matrix else 0.0) for numel, matrix in shapes]


def timed_model() -> tuple[nn.Module, float, dict[str, float]]:
    """The model (``TimedLayer``s that do not wait: the clock is replayed, not waited for), its
    forward seconds and each parameter's backward seconds, as ``tuned_bucket_mb`` gets them."""
    from minidist.clock import TimedLayer

    layout = timed_layout()
    model = nn.Sequential(*(TimedLayer(numel, 0.0, 0.0) for numel, _ in layout))
    rate = TIMED["flops_per_s"]
    backward = {f"{i}.weight": 2 * flops / rate for i, (_, flops) in enumerate(layout)}
    return model, sum(flops for _, flops in layout) / rate, backward


def ring_seconds(nbytes: float, p: int = 2) -> float:
    """Lecture 2's ring allreduce on the link: 2(p-1) alpha + 2(p-1)/p bytes / bandwidth."""
    return 2 * (p - 1) * ALPHA_S + 2 * (p - 1) / p * nbytes / BANDWIDTH_BPS


def timed_rank(comm, cap_mb: float | None) -> list:
    """One rank: your DDP on the timed model with ``cap_mb`` (None: what your ``tuned_bucket_mb``
    returns); the order of this backward's events: ("ready", name), ("call", bytes)."""
    ddp = importlib.import_module("ddp")
    model, forward_s, backward_s = timed_model()
    if cap_mb is None:
        cap_mb = ddp.tuned_bucket_mb(
            list(model.named_parameters()),
            forward_s,
            dict(backward_s),
            ALPHA_S,
            BANDWIDTH_BPS,
            comm.world_size,
        )
    events: list = []
    for name, param in model.named_parameters():  # registered before your hooks: they run first
        param.register_post_accumulate_grad_hook(lambda _p, name=name: events.append(("ready", name)))
    original = md.allreduce

    def allreduce(comm_, tensor, *args, **kwargs):
        events.append(("call", tensor.numel() * tensor.element_size()))
        return original(comm_, tensor, *args, **kwargs)

    md.allreduce = allreduce
    wrapped = ddp.BucketedDDP(model, comm, cap_mb)
    wrapped(torch.zeros(1)).sum().backward()
    return [float(cap_mb), len(wrapped.buckets), events]


def emulated_step(events: list, p: int = 2) -> float:
    """The step replayed on the emulated clock, as the grader does: the forward, then each
    gradient after its parameter's backward seconds; an allreduce starts when launched or when
    the link is free, whichever is later; the step ends with backward and the last allreduce.
    (The grader also makes the training thread wait wherever your code waits for a handle.)"""
    _, forward_s, backward_s = timed_model()
    clock, link_free = forward_s, 0.0
    for kind, what in events:
        if kind == "ready":
            clock += backward_s[what]
        else:
            link_free = max(clock, link_free) + ring_seconds(what, p)
    return max(clock, link_free)


def lower_bound(p: int = 2) -> float:
    """max(compute, communication): forward and backward, or one allreduce of every gradient."""
    _, forward_s, backward_s = timed_model()
    total = 4 * sum(numel for numel, _ in timed_layout())
    return max(forward_s + sum(backward_s.values()), ring_seconds(total, p))


def measure_step_time(cap_mb: float | None = None, timeout: float = 60) -> tuple[float, int, float]:
    """(cap, buckets, emulated step / lower bound) of your DDP on the timed model, 2 ranks."""
    cap, buckets, events = md.launch(timed_rank, 2, args=(cap_mb,), timeout=timeout)[0]
    return cap, buckets, emulated_step(events) / lower_bound()


def ddp_run(setup: Setup, record: bool = False, timeout: float = 60) -> list[dict]:
    """``ddp_rank`` on ``setup.ranks`` ranks; one report per rank."""
    return md.launch(ddp_rank, setup.ranks, args=(setup, record), transport=setup.transport, timeout=timeout)


def largest_difference(reports: list[dict], reference: dict, key: str) -> float:
    """The largest |rank's value - one process's| over every rank and parameter (None == None)."""
    worst = 0.0
    for report in reports:
        for name, expected in reference[key].items():
            got = report[key][name]
            if (got is None) != (expected is None):
                return float("inf")
            if got is not None:
                worst = max(worst, (got - expected).abs().max().item())
    return worst


def try_run(function, *args, **kwargs):
    """``function(*args)``, or None (and a note) while a part of ``ddp.py`` is not written yet."""
    try:
        return function(*args, **kwargs)
    except md.WorkerError as error:
        if error.exc_type != "NotImplementedError":
            raise
        print(f"not implemented yet ({error.summary}): nothing to show.")
        return None


#: one public test per task: what the course's own CI runs from this notebook
#: (MINIDIST_PUBLIC_TESTS=one-per-task), where the whole file is run once by `make test`
ONE_PER_TASK = [
    "test_buckets_of_the_docstring_example",
    "test_the_first_bucket_is_launched_while_backward_computes",
    "test_matches_one_process",
    "test_no_sync_accumulates",
]


def run_public_tests(*pytest_args: str) -> bool:
    """Run test_a3_ddp.py in a fresh process (your latest code); print its report."""
    targets = ["test_a3_ddp.py"]
    if os.environ.get("MINIDIST_PUBLIC_TESTS") == "one-per-task" and not pytest_args:
        targets = [f"test_a3_ddp.py::{name}" for name in ONE_PER_TASK]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets]
    result = subprocess.run([*command, *pytest_args], cwd=HERE, capture_output=True, text=True)
    print(result.stdout[-20_000:], result.stderr[-5_000:], sep="")
    return result.returncode == 0
