"""Helpers of assignment 9's notebook and public tests: Streaming DiLoCo on p workers and in one
process, a fault-tolerant run with kills, and the measured run.

Every worker of a Streaming run builds the same linear regression from a seed, trains it with
plain gradient descent on its own batches (worker r's targets are shifted by r: the workers' data
differ) and calls your ``StreamingSync.after_inner_step()`` after each step. ``one_process``
computes the same p workers side by side in this process from lecture 11's formulas, written out
here (not with your functions): your run must agree with it after every step. The fault-tolerant
run trains with the library's ``elastic.FaultTolerant`` given your ``exchange`` and ``average``,
SIGKILLing the ranks you name; ``elastic.replay`` is its one-process reference. Your
``resilient`` module is imported inside the worker processes only, afresh at every launch.
"""

from __future__ import annotations

import importlib
import os
import signal
from dataclasses import asdict, dataclass, replace

import torch

import minidist as md


@dataclass(frozen=True)
class Setup:
    """A Streaming DiLoCo run: ``workers`` workers, ``steps`` inner steps, then ``flush``."""

    workers: int = 2
    inputs: int = 3
    outputs: int = 2
    batch: int = 4
    inner_lr: float = 0.05
    inner_steps: int = 4
    fragments: int = 2
    delay: int = 1
    mix: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    steps: int = 10
    seed: int = 0
    noise: float = 1.0

    def design(self) -> dict:
        keys = ("inner_steps", "fragments", "delay", "mix", "outer_lr", "outer_momentum")
        return {k: getattr(self, k) for k in keys}


#: the measured task's run, as the grader runs it (the same for everyone)
MEASURED = Setup(inputs=24, outputs=24, batch=32, inner_lr=0.1, steps=200, seed=7, noise=0.5)
TARGET = 1.0  # held-out loss
LINK_BYTES_PER_S, LATENCY_S, FLOPS = 100e6 / 8, 5e-4, 1e9  # 100 Mbit/s, 0.5 ms a message, 1 GFLOP/s


def _draw(shape, *keys: int) -> torch.Tensor:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key)) % 2**61
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def start(setup: Setup) -> list[torch.Tensor]:
    """The model every worker starts from: a weight (inputs x outputs) and a bias."""
    return [_draw([setup.inputs, setup.outputs], setup.seed, 0), _draw([setup.outputs], setup.seed, 1)]


def teacher(setup: Setup) -> torch.Tensor:
    return _draw([setup.inputs, setup.outputs], setup.seed, 4)


def batch(setup: Setup, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = _draw([setup.batch, setup.inputs], setup.seed, 2, rank, step)
    noise = _draw([setup.batch, setup.outputs], setup.seed, 3, rank, step)
    return x, x @ teacher(setup) + rank + setup.noise * noise


def inner_step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    weight, bias = (p.detach().requires_grad_(True) for p in params)
    grads = torch.autograd.grad(((x @ weight + bias - y) ** 2).mean(), (weight, bias))
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g)


def heldout_loss(setup: Setup, flat: torch.Tensor) -> float:
    """Mean squared error over every worker's distribution (no noise) of flattened parameters."""
    n = setup.inputs * setup.outputs
    weight, bias = flat[:n].view(setup.inputs, setup.outputs), flat[n:]
    x = _draw([64, setup.inputs], setup.seed, 5)
    target = x @ teacher(setup)
    return float(
        sum(((x @ weight + bias - target - r) ** 2).mean() for r in range(setup.workers)) / setup.workers
    )


def streaming_worker(comm, setup: Setup, flush: bool = True, your_design: bool = False) -> dict:
    """Train with your StreamingSync (``your_design``: with your ``design()`` instead of the setup's);
    this worker's flattened parameters after every step (and after ``flush``), and the transport's
    cumulative bytes and messages after every step."""
    resilient = importlib.import_module("resilient")
    params = start(setup)
    design = resilient.design() if your_design else setup.design()
    sync = resilient.StreamingSync(comm.without_shortcuts(), params, **design)  # as the grader's
    trajectory, traffic = [], []
    for step in range(1, setup.steps + 1):
        inner_step(params, *batch(setup, comm.rank, step), setup.inner_lr)
        sync.after_inner_step()
        trajectory.append(torch.cat([p.detach().reshape(-1) for p in params]))
        traffic.append((comm.stats.bytes_sent, comm.stats.messages_sent))
    if flush:
        sync.flush()
    return {"trajectory": trajectory, "final": torch.cat([p.reshape(-1) for p in params]), "traffic": traffic}


def one_process(setup: Setup, flush: bool = True) -> dict:
    """The p workers of ``streaming_worker`` in this process, lecture 11's rules written out."""
    h, nf, tau, mix = setup.inner_steps, setup.fragments, setup.delay, setup.mix
    lr, mu = setup.outer_lr, setup.outer_momentum
    theta = torch.cat([p.reshape(-1) for p in start(setup)])
    n, v = theta.numel(), torch.zeros_like(theta)
    local = [theta.clone() for _ in range(setup.workers)]
    bounds = [(f * n // nf, (f + 1) * n // nf) for f in range(nf)]
    pending: list[tuple[int, int, torch.Tensor]] = []  # (apply after step, fragment, average)

    def apply(item):
        pending.remove(item)
        _, f, delta = item
        lo, hi = bounds[f]
        v[lo:hi] = mu * v[lo:hi] + delta
        theta[lo:hi] = theta[lo:hi] - lr * (delta + mu * v[lo:hi])
        for x in local:
            x[lo:hi] = mix * x[lo:hi] + (1 - mix) * theta[lo:hi]

    trajectory = [[] for _ in local]
    for t in range(1, setup.steps + 1):
        for r, x in enumerate(local):
            params = [
                x[: setup.inputs * setup.outputs].view(setup.inputs, setup.outputs),
                x[-setup.outputs :],
            ]
            inner_step(params, *batch(setup, r, t), setup.inner_lr)
        for item in [i for i in pending if i[0] == t]:
            apply(item)
        for f in range(nf):
            offset = (f + 1) * h // nf
            if t >= offset and (t - offset) % h == 0:
                lo, hi = bounds[f]
                item = (t + tau, f, sum(theta[lo:hi] - x[lo:hi] for x in local) / len(local))
                pending.append(item)
                if tau == 0:
                    apply(item)
        for r, x in enumerate(local):
            trajectory[r].append(x.clone())
    if flush:
        for item in list(pending):
            apply(item)
    return {"trajectory": trajectory, "final": [x.clone() for x in local]}


def run(worker, ranks: int, *args, transport: str = "shm") -> list:
    return md.launch(worker, ranks, args=args, transport=transport, timeout=60)


def curve(setup: Setup, out: dict) -> tuple[list[float], list[float]]:
    """Rank 0's report as (emulated ms after each step, held-out loss after it): t inner steps of
    compute at FLOPS, the bytes sent over the link, LATENCY_S a message."""
    compute = 6 * (setup.inputs * setup.outputs + setup.outputs) * setup.batch / FLOPS
    ms = [
        1e3 * (t * compute + nbytes / LINK_BYTES_PER_S + messages * LATENCY_S)
        for t, (nbytes, messages) in enumerate(out["traffic"], start=1)
    ]
    return ms, [heldout_loss(setup, flat) for flat in out["trajectory"]]


def time_to_target_ms(setup: Setup, out: dict) -> float | None:
    """The measured task's value from rank 0's report: emulated ms to the target, None if missed."""
    return next((ms for ms, loss in zip(*curve(setup, out)) if loss <= TARGET), None)


# --- the fault-tolerant run -------------------------------------------------------------------
class MomentumSGD:
    """v <- mu v + g, p <- p - lr v (with state_dict for the recovery of a replacement)."""

    def __init__(self, params, lr: float = 0.1, mu: float = 0.9) -> None:
        self.params, self.lr, self.mu = list(params), lr, mu
        self.buffers = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        for p, v in zip(self.params, self.buffers):
            v.mul_(self.mu).add_(p.grad)
            p.sub_(self.lr * v)

    def state_dict(self) -> dict:
        return {"buffers": [v.clone() for v in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        for mine, theirs in zip(self.buffers, state["buffers"]):
            mine.copy_(theirs)


def make_model(features: int) -> tuple[torch.nn.Module, MomentumSGD]:
    torch.manual_seed(0)
    model = torch.nn.Linear(features, features, dtype=torch.float64)
    return model, MomentumSGD(model.parameters())


def loss_of(model: torch.nn.Module, slot: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(3, model.in_features, generator=g, dtype=torch.float64)
    return ((model(x) - slot) ** 2).mean()


def quorum_worker(comm, steps: int, features: int, kills: dict) -> dict:
    """Train with FaultTolerant and your exchange/average; SIGKILL ourselves where
    ``kills[f"{slot}.{incarnation}"] == [point, step]`` (a FaultTolerant ``on_point`` name)."""
    from minidist.parallel import elastic

    resilient = importlib.import_module("resilient")
    slot, incarnation = elastic.identity()
    point, when = kills.get(f"{slot}.{incarnation}", ["", -1])

    def on_point(name: str, step: int) -> None:
        if (name, step) == (point, when):
            os.kill(os.getpid(), signal.SIGKILL)

    model, optimizer = make_model(features)
    sent = []

    def exchange(comm, flat, members, me, step):
        before = comm.stats.bytes_sent
        held = resilient.exchange(comm, flat, members, me, step)
        sent.append((len(members), comm.stats.bytes_sent - before, flat.numel() * flat.element_size()))
        return held

    ft = elastic.FaultTolerant(
        comm, model, optimizer, steps, on_point=on_point, exchange=exchange, average=resilient.average
    )
    while ft.step < steps:
        if ft.train_step(lambda step: loss_of(model, slot, step)) is None:
            break
    return {"history": ft.history, "params": [p.detach().clone() for p in model.parameters()], "sent": sent}


def run_quorum(ranks: int, steps: int, features: int, kills: dict, max_restarts: int = 1) -> list:
    from minidist.parallel import elastic

    return md.launch(
        quorum_worker,
        ranks,
        args=(steps, features, kills),
        transport="pipe",
        timeout=60,
        start_method="forkserver",
        elastic=elastic.Policy(min_size=2, max_restarts=max_restarts),
    )


def replayed(history: list[list[int]], features: int) -> list[torch.Tensor]:
    """The library's one-process replay of ``history``: the parameters every survivor must hold."""
    from minidist.parallel import elastic

    model, _ = elastic.replay(history, lambda: make_model(features), loss_of)
    return [p.detach() for p in model.parameters()]


__all__ = [
    "MEASURED",
    "Setup",
    "asdict",
    "curve",
    "one_process",
    "replace",
    "run",
    "run_quorum",
    "streaming_worker",
]
