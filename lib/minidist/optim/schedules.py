"""Learning rates for large batches: scaling rules, gradual warm-up, warm-up + decay.

A global batch k times larger averages k times more gradients, so its gradient is as noisy as
the small batch's divided by k (variance / k). One large step should then go about as far as
the k small steps it replaces -- the *linear scaling rule* (Goyal et al., 2017):

    lr(batch) = base_lr · batch / base_batch                     (SGD)

For Adam-family optimisers the update is already normalised by the gradient's scale, and the
rule that matches the noise (the standard deviation falls as 1/sqrt(k)) is the *square-root*
rule (Hoffer et al., 2017; Malladi et al., 2022):

    lr(batch) = base_lr · sqrt(batch / base_batch)               (Adam, LAMB)

Early in training the weights move fast and a large learning rate makes the first steps
diverge; *gradual warm-up* starts from ``start_lr`` (Goyal: base_lr; BERT: 0) and rises by
the same amount every step until it reaches the scaled rate after ``warmup_steps`` steps:

    lr  ▲        ______________ target_lr
        │      /
        │    /                      lr(t) = start + (target - start) · t / warmup   (t < warmup)
        │  /                        lr(t) = target                                   (t >= warmup)
        │/ start_lr
        └──────┴──────────────► step t (counted from 0: the first step uses lr(0) = start)

``warmup_decay_factor`` adds a decay after the warm-up (linear or cosine to ``final_factor``)
and returns a *factor* of the optimiser's lr, the form ``torch.optim.lr_scheduler.LambdaLR``
takes; ``warmup_decay_schedule`` builds that scheduler.
"""

from __future__ import annotations

import math
from functools import partial

import torch

__all__ = [
    "SCALING_RULES",
    "linear_scaled_lr",
    "scaled_lr",
    "sqrt_scaled_lr",
    "warmup_decay_factor",
    "warmup_decay_schedule",
    "warmup_lr",
]

SCALING_RULES = ("linear", "sqrt", "none")


def _check_batches(batch_size: int, base_batch_size: int) -> None:
    if batch_size < 1 or base_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, got batch={batch_size}, base_batch={base_batch_size}")


def linear_scaled_lr(base_lr: float, batch_size: int, base_batch_size: int) -> float:
    """Goyal et al.'s rule: ``base_lr · batch_size / base_batch_size``."""
    _check_batches(batch_size, base_batch_size)
    return base_lr * batch_size / base_batch_size


def sqrt_scaled_lr(base_lr: float, batch_size: int, base_batch_size: int) -> float:
    """The square-root rule for Adam-family optimisers: ``base_lr · sqrt(batch_size / base_batch_size)``."""
    _check_batches(batch_size, base_batch_size)
    return base_lr * math.sqrt(batch_size / base_batch_size)


def scaled_lr(base_lr: float, batch_size: int, base_batch_size: int, rule: str = "linear") -> float:
    """``base_lr`` scaled from ``base_batch_size`` to ``batch_size`` by ``rule``: linear, sqrt or none."""
    if rule == "linear":
        return linear_scaled_lr(base_lr, batch_size, base_batch_size)
    if rule == "sqrt":
        return sqrt_scaled_lr(base_lr, batch_size, base_batch_size)
    if rule == "none":
        _check_batches(batch_size, base_batch_size)
        return base_lr
    raise ValueError(f"unknown scaling rule {rule!r}: use one of {SCALING_RULES}")


def warmup_lr(step: int, target_lr: float, warmup_steps: int, start_lr: float = 0.0) -> float:
    """Gradual warm-up: ``start_lr`` at step 0, rising linearly to ``target_lr`` at ``warmup_steps``."""
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step and warmup_steps must be >= 0, got {step}, {warmup_steps}")
    if step >= warmup_steps:
        return target_lr
    return start_lr + (target_lr - start_lr) * step / warmup_steps


def warmup_decay_factor(
    step: int,
    warmup_steps: int,
    total_steps: int,
    decay: str = "linear",
    start_factor: float = 0.0,
    final_factor: float = 0.0,
) -> float:
    """Multiplier of the peak lr at ``step`` (from 0): warm-up from ``start_factor`` to 1, then decay.

    Warm-up as ``warmup_lr`` (factor ``start_factor`` at step 0, 1 at ``warmup_steps``); then
    "linear" falls to ``final_factor`` at ``total_steps``, "cosine" follows half a cosine down to
    ``final_factor``, "none" stays at 1. Steps past ``total_steps`` keep ``final_factor``.
    """
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps <= total_steps, got {warmup_steps}, {total_steps}")
    if step < warmup_steps:
        return warmup_lr(step, 1.0, warmup_steps, start_factor)
    if decay == "none":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay == "linear":
        return 1.0 + (final_factor - 1.0) * progress
    if decay == "cosine":
        return final_factor + (1.0 - final_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown decay {decay!r}: use 'linear', 'cosine' or 'none'")


def warmup_decay_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    decay: str = "linear",
    start_factor: float = 0.0,
    final_factor: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` whose factor is ``warmup_decay_factor``: call ``.step()`` after each optimiser step.

    The optimiser's ``lr`` (per group) is the peak; the first optimiser step runs at
    ``start_factor · lr``.
    """
    factor = partial(
        warmup_decay_factor,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        decay=decay,
        start_factor=start_factor,
        final_factor=final_factor,
    )
    warmup_decay_factor(
        0, warmup_steps, total_steps, decay, start_factor, final_factor
    )  # check arguments now
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
