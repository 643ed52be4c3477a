"""``DiLoCo`` and ``LocalSGD``: H inner steps on each worker, then one outer step on the average.

    trainer = DiLoCo(model, comm, torch.optim.AdamW(model.parameters(), lr=1e-3), inner_steps=H)
    for batch in my_batches:                    # this worker's own data
        loss = trainer.step(loss_fn, batch)     # loss_fn(model, batch) -> scalar tensor
    trainer.flush()                             # apply fragments still in flight (Streaming)

One round, per worker (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training
of Language Models"; the paper: AdamW inner, H = 500, outer Nesterov lr 0.7, momentum 0.9)::

    theta_i <- theta                            every worker starts from the global parameters
    H x: theta_i <- AdamW(theta_i, grad of loss on my batch)          no communication
    delta   <- allreduce_avg(theta - theta_i)   the pseudo-gradient (``payload``)
    theta   <- Nesterov outer step(theta, delta)                     (``outer``)
    theta_i <- theta                            and the next round starts

The inner optimizer's state (AdamW's moments) stays on each worker across rounds; the global
parameters and the outer momentum are replicated: every rank computes the same outer step from
the same averaged delta (and starts from rank 0's parameters, broadcast once here).

Traffic: one average of the model per H steps, so a rank sends 2(p-1)/p x 4N / H bytes per
inner step (ring, N parameters in fp32), or (p-1) x payload / H quantized (``payload``) --
bytes per token fall as 1/H. DDP sends 2(p-1)/p x 4N every step.

Streaming (``fragments=F``, ``delay=tau``, ``mix=alpha``; Douillard et al. 2025): the vector is
cut into F slices synchronised on staggered schedules (``schedule``: the timeline); a fragment's
exchange starts after step t (``async_op=True``) and is applied after step t + tau, while the
worker keeps training. At that point the fragment's local values have moved on for tau steps;
the paper merges them with the new global values, theta_i <- alpha theta_i + (1 - alpha) theta
(``mix=alpha``; the default 0 replaces them, which for tau = 0 is DiLoCo exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from minidist.collectives import broadcast
from minidist.comm import Communicator

from .outer import nesterov_outer_step_
from .payload import QUANTIZE, PendingAverage, average_async
from .schedule import fragment_bounds, fragment_offsets, fragments_due

__all__ = ["DiLoCo", "LocalSGD"]


@dataclass
class _InFlight:
    fragment: int
    apply_after: int  # the inner step after which it is applied
    exchange: PendingAverage


class DiLoCo:
    """DiLoCo / Streaming DiLoCo on ``comm`` (see the module). ``step(loss_fn, batch) -> loss``.

    ``model``'s trainable parameters must be fp32 (the outer state is kept in fp32 beside them).
    Counters for tests and notebooks: ``inner_step`` (steps taken), ``launched[f]`` (the inner
    steps after which fragment f was launched), ``applied[f]`` (after which it was applied).

    Two seams, for exercises: ``outer_step(global_slice, momentum_slice, averaged, lr, mu)``
    updates a fragment's slices in place (default ``outer.nesterov_outer_step_``), and
    ``schedule(t, H, F) -> [fragments launched after step t]`` (default
    ``schedule.fragments_due``); a schedule must not launch a fragment again before its previous
    launch is applied (``delay`` steps later).
    """

    def __init__(
        self,
        model: nn.Module,
        comm: Communicator,
        inner_optimizer: torch.optim.Optimizer,
        inner_steps: int = 500,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        fragments: int = 1,
        quantize: str | None = None,
        *,
        delay: int = 0,
        mix: float = 0.0,
        outer_step: Callable[..., None] = nesterov_outer_step_,
        schedule: Callable[[int, int, int], list[int]] = fragments_due,
    ) -> None:
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1 (H inner steps per outer step), got {inner_steps}")
        fragment_offsets(inner_steps, fragments)  # checks 1 <= fragments <= inner_steps
        if not 0 <= delay < inner_steps:
            raise ValueError(
                f"delay must lie in 0..inner_steps-1={inner_steps - 1} (a fragment is applied before it is "
                f"launched again), got {delay}"
            )
        if quantize not in QUANTIZE:
            raise ValueError(f"quantize must be one of {QUANTIZE} (None sends fp32), got {quantize!r}")
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"mix must lie in [0, 1): the local values' weight in the merge, got {mix}")
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params or any(p.dtype != torch.float32 for p in self.params):
            raise TypeError("DiLoCo needs a model with trainable fp32 parameters (cast with model.float())")
        self.model, self.comm, self.inner_optimizer = model, comm, inner_optimizer
        self.inner_steps, self.fragments, self.quantize = inner_steps, fragments, quantize
        self.outer_lr, self.outer_momentum, self.delay, self.mix = outer_lr, outer_momentum, delay, mix
        self.outer_step, self.schedule = outer_step, schedule
        start = self._local_flat()
        broadcast(comm, start, src=0)  # every worker starts from rank 0's parameters
        self._write(start, 0, start.numel())
        self.global_params = start.clone()
        self.momentum = torch.zeros_like(start)
        self.bounds = fragment_bounds(start.numel(), fragments)
        self.inner_step = 0
        self.launched: list[list[int]] = [[] for _ in range(fragments)]
        self.applied: list[list[int]] = [[] for _ in range(fragments)]
        self._in_flight: list[_InFlight] = []

    @property
    def numel(self) -> int:
        return self.global_params.numel()

    def _local_flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write(self, values: torch.Tensor, lo: int, hi: int) -> None:
        """Copy ``values`` (flat, hi - lo long) into the parameters' elements lo..hi."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                a, b = max(lo, offset), min(hi, offset + p.numel())
                if a < b:
                    p.view(-1)[a - offset : b - offset].copy_(values[a - lo : b - lo])
                offset += p.numel()

    def step(self, loss_fn: Callable[[nn.Module, object], torch.Tensor], batch) -> torch.Tensor:
        """One inner step on this worker's ``batch`` (``loss_fn(model, batch)`` -> scalar), then
        whatever the schedule says: apply fragments due now, launch fragments due now."""
        self.inner_optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, batch)
        loss.backward()
        self.inner_optimizer.step()
        self.inner_step += 1
        t = self.inner_step
        for item in [x for x in self._in_flight if x.apply_after == t]:
            self._apply(item)
        for f in self.schedule(t, self.inner_steps, self.fragments):
            self._launch(f)
        return loss.detach()

    def _launch(self, f: int) -> None:
        lo, hi = self.bounds[f]
        delta = self.global_params[lo:hi] - self._local_flat()[lo:hi]  # theta - theta_i
        item = _InFlight(f, self.inner_step + self.delay, average_async(self.comm, delta, self.quantize))
        self.launched[f].append(self.inner_step)
        self._in_flight.append(item)
        if self.delay == 0:
            self._apply(item)

    def _apply(self, item: _InFlight) -> None:
        self._in_flight.remove(item)
        lo, hi = self.bounds[item.fragment]
        averaged = item.exchange.wait()
        self.outer_step(
            self.global_params[lo:hi], self.momentum[lo:hi], averaged, self.outer_lr, self.outer_momentum
        )
        merged = self.global_params[lo:hi]
        if self.mix:
            merged = self.mix * self._local_flat()[lo:hi] + (1 - self.mix) * merged
        self._write(merged, lo, hi)
        self.applied[item.fragment].append(self.inner_step)

    def flush(self) -> None:
        """Wait for and apply every fragment still in flight (call once, after the last step)."""
        for item in list(self._in_flight):
            self._apply(item)


class LocalSGD(DiLoCo):
    """Plain local SGD (federated averaging): every ``inner_steps`` steps the workers' parameters
    are replaced by their average. That is DiLoCo's outer step with lr 1 and no momentum
    (theta - (1/p) sum_i (theta - theta_i) = (1/p) sum_i theta_i), so it is written as one."""

    def __init__(
        self, model: nn.Module, comm: Communicator, inner_optimizer: torch.optim.Optimizer, inner_steps: int
    ) -> None:
        super().__init__(model, comm, inner_optimizer, inner_steps, outer_lr=1.0, outer_momentum=0.0)
