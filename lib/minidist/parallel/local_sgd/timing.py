"""Time to a target loss on the emulated clock: compute per step, syncs, and Streaming's overlap.

A run's held-out curve ``[(step, loss), ...]`` says *when* (in inner steps) it first reaches a
target loss; this module turns steps into seconds on a stated machine, so that DDP, DiLoCo and
Streaming DiLoCo can be compared on a slow link without running on one::

    compute_s = 6 N T / (peak FLOP/s x MFU)     one inner step: N parameters, T tokens a worker
    time      = t* x compute_s + (launches by t*) x max(0, sync_s / F - tau x compute_s)

``t*`` is the first step of the curve with loss <= target; ``sync_s`` is one average of the
whole model's pseudo-gradient (measured over ``transport.emulated.EmulatedLinkComm``, or
``cost_model.predict``); a fragment carries 1/F of it. A fragment launched after step t is
needed after step t + tau: the tau steps of compute run while it crosses the link, and the
worker waits only for what is left (H = 50, F = 5, tau = 5)::

    step        10   11   12   13   14   15   16 ...   20   21 ...
    compute     [==][==][==][==][==][==][==]            [==]
    fragment 0  L====================A                        (sync_s / F > 5 compute_s)
                                     ^ waits max(0, sync_s/F - 5 compute_s)
    fragment 1                                          L=====...

The special cases: DDP is H = 1, F = 1, tau = 0 (a sync after every step, none of it hidden:
the overlap of backward with the allreduce is not modelled); DiLoCo is F = 1, tau = 0 (t*//H
syncs, each waited for whole). The model assumes the link is free when a fragment is launched,
which holds while F tau <= H (at most one fragment in flight); with more in flight they queue
on the link and the formula is optimistic.
"""

from __future__ import annotations

from collections.abc import Callable

from .schedule import fragments_due

__all__ = ["step_compute_s", "steps_to_target", "time_to_target"]


def step_compute_s(numel: int, tokens: int, flops_per_s: float) -> float:
    """Seconds of one training step's compute: 6 N T FLOPs (forward 2 N T, backward 4 N T) at
    ``flops_per_s`` (peak x MFU, e.g. ``clock.V100_40.flops_per_s``)."""
    if numel < 1 or tokens < 1 or flops_per_s <= 0:
        raise ValueError(f"need numel, tokens >= 1 and flops_per_s > 0, got {numel}, {tokens}, {flops_per_s}")
    return 6 * numel * tokens / flops_per_s


def steps_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first step of ``curve`` (``(step, loss)`` pairs, in order) with loss <= ``target``;
    None if the curve never gets there."""
    return next((step for step, loss in curve if loss <= target), None)


def time_to_target(
    curve: list[tuple[int, float]],
    target: float,
    compute_s: float,
    sync_s: float,
    inner_steps: int = 1,
    fragments: int = 1,
    delay: int = 0,
    schedule: Callable[[int, int, int], list[int]] = fragments_due,
) -> float | None:
    """Seconds until ``curve`` reaches ``target`` (the module's formula); None if it never does.

    ``inner_steps`` H, ``fragments`` F and ``delay`` tau as in ``DiLoCo``; DDP is the default
    (H = 1: a sync every step). Launches are counted with ``schedule`` up to the step reached.
    """
    if compute_s < 0 or sync_s < 0:
        raise ValueError(f"compute_s and sync_s are seconds (>= 0), got {compute_s}, {sync_s}")
    reached = steps_to_target(curve, target)
    if reached is None:
        return None
    launches = sum(len(schedule(t, inner_steps, fragments)) for t in range(1, reached + 1))
    return reached * compute_s + launches * max(0.0, sync_s / fragments - delay * compute_s)
