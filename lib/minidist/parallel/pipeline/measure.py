"""The bubble measured on real processes: stages that wait (emulated compute), against the formula.

``measure_bubble(p, m, schedule_fn)`` launches p ranks whose stages only wait (``SleepStage``:
emulated compute, ``minidist.clock.wait``; waiting takes no CPU, so p stages show their
schedule's timing on a 2-core machine), runs
the schedule with ``executor.run_pipeline`` and returns the measured bubble beside
``schedules.bubble_formula`` and ``simulator.simulate``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...clock import wait
from ...comm import Communicator
from .executor import run_pipeline, timeline_of
from .schedules import bubble_formula, one_f_one_b
from .simulator import simulate

__all__ = ["SleepStage", "measure_bubble"]


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_forward, t_backward):
        ctx.t_backward = t_backward
        wait(t_forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait(ctx.t_backward)
        return grad, None, None


class SleepStage(nn.Module):
    """A stage whose work is a wait (emulated compute): t_forward in forward, t_backward in backward.

    ``minidist.clock.wait`` sleeps, then spins the last 0.2 ms (a plain sleep overshoots): it
    takes almost no CPU, so p stages show their schedule's timing on a 2-core machine.
    """

    def __init__(self, t_forward: float, t_backward: float) -> None:
        super().__init__()
        self.t_forward, self.t_backward = t_forward, t_backward
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.t_forward, self.t_backward)


def _bubble_worker(comm: Communicator, schedule, t_forward: float, t_backward: float, chunks: int):
    modules = [SleepStage(t_forward / chunks, t_backward / chunks) for _ in range(chunks)]
    m = 1 + max(a[1] for a in schedule[comm.rank])
    inputs = torch.zeros(m, 4) if comm.rank == 0 else None
    targets = torch.zeros(m, 4) if comm.rank == comm.world_size - 1 else None
    for _ in range(2):  # the first step pays one-time costs (autograd's first backward): measure the second
        out = run_pipeline(
            modules if chunks > 1 else modules[0],
            comm,
            schedule[comm.rank],
            inputs=inputs,
            targets=targets,
            loss_fn=lambda y, t: ((y - t) ** 2).mean(),
        )
    return out


def measure_bubble(
    stages: int,
    microbatches: int,
    schedule_fn: Callable = one_f_one_b,
    t_forward: float = 0.02,
    t_backward: float = 0.04,
    *,
    chunks: int = 1,
    transport: str = "shm",
    timeout: float = 120.0,
) -> dict:
    """Launch ``stages`` ranks running sleep-timed stages under a schedule; return the measured bubble.

    Returns a dict: ``measured`` (1 - busy / (p x makespan), from the recorded action times),
    ``formula`` (``bubble_formula``), ``simulated`` (``simulate``), ``wall_s`` (the makespan),
    ``timeline`` (the measured ``Timeline``, for ``plot_timeline``) and the per-rank results.
    Runs the step twice and measures the second (the first pays one-time costs).
    Cost: about 2 (m + p - 1) (t_forward + t_backward) seconds plus the launch (~1-2 s).
    """
    from minidist.launch import launch  # lazily: launching is not the schedules' concern

    schedule = schedule_fn(stages, microbatches, chunks) if chunks > 1 else schedule_fn(stages, microbatches)
    outs = launch(
        _bubble_worker,
        stages,
        args=(schedule, t_forward, t_backward, chunks),
        transport=transport,
        timeout=timeout,
    )
    measured = timeline_of(outs)  # one clock (perf_counter) for every rank on this machine
    return {
        "measured": measured.bubble_fraction,
        "formula": bubble_formula(stages, microbatches, chunks),
        "simulated": simulate(schedule, t_forward, t_backward).bubble_fraction,
        "wall_s": measured.makespan,
        "timeline": measured,
        "results": outs,
    }
