"""Assignment 9: training that survives a slow link and a dead machine -- Streaming DiLoCo, a quorum step.

Lecture 11 builds both on the library (``local_sgd.DiLoCo``, ``elastic.FaultTolerant``); here you
write their hearts yourself:

* ``nesterov_step_`` and ``fragments_due`` (task 1): DiLoCo's outer step and Streaming DiLoCo's
  schedule, on one process;
* ``StreamingSync`` (task 2): the synchronisation of Streaming DiLoCo on a communicator -- which
  fragment is launched after which inner step, its pseudo-gradient averaged over the workers,
  applied ``delay`` steps later and mixed into the local parameters, and ``flush`` at the end;
* ``exchange`` and ``average`` (task 3): the gradient exchange of the fault-tolerant step and the
  average over the contributors, plugged into the library's ``elastic.FaultTolerant``, which
  the grader runs while it SIGKILLs ranks.

The rules, as lecture 11 states them:

- **The outer step** (torch.optim.SGD's convention, dampening 0): the pseudo-gradient
  delta = (1/p) sum_i (theta - theta_i), the pseudo-gradient, takes a gradient's place::

      v     <- mu v + delta                     (momentum buffer, starts at 0)
      theta <- theta - lr (delta + mu v)        (Nesterov: look one momentum step ahead)

- **The fragment schedule** (inner steps counted from 1)::

      offset_f = (f + 1) H // F                  f = 0 .. F-1
      fragment f is launched after step t  iff   t >= offset_f and (t - offset_f) % H == 0
      and applied (outer step + merge)   after step t + tau

  Fragments are the contiguous slices ``fragment_bounds(numel, F)`` of the flattened parameters.
  At launch a fragment's pseudo-gradient is the global slice minus this worker's local slice, and
  it is averaged over the workers; at apply the outer step updates the global slice and momentum
  and the local slice becomes ``mix * local + (1 - mix) * global``. Fragments due at the same step
  are applied first, then launched; with tau = 0 a launch is applied at once.
- **The contributors**: the step's gradient is averaged over the slots the coordinator commits
  (those whose gradients every survivor holds), added in slot order, divided by their number.
- **What you may use**: ``comm.send``, ``recv``, ``isend``, ``irecv``, and for the pseudo-gradient's
  average ``md.allreduce`` (communication is lecture 2's lesson, not this one); plain torch. Not
  the library's DiLoCo (``minidist.parallel.local_sgd``), its fault-tolerant step's exchange and
  average, ``elastic.replay`` (it sums in the same order), ``torch.optim.SGD`` and the functions
  behind it (the outer step *is* Nesterov SGD) nor ``torch.distributed``.
"""

from __future__ import annotations

import torch

# what your code needs (noqa: the released file does not use them yet)
import minidist as md  # noqa: F401
from minidist.comm import Communicator
from minidist.errors import PeerError  # noqa: F401

__all__ = [
    "StreamingSync",
    "average",
    "design",
    "exchange",
    "fragment_bounds",
    "fragments_due",
    "nesterov_step_",
]


def fragment_bounds(numel: int, fragments: int) -> list[tuple[int, int]]:
    """F contiguous ``(lo, hi)`` slices of ``range(numel)``, sizes differing by at most one. (Given.)"""
    return [(f * numel // fragments, (f + 1) * numel // fragments) for f in range(fragments)]


# --- task 1: the outer step and the schedule ----------------------------------------------------
def nesterov_step_(
    params: torch.Tensor, momentum: torch.Tensor, delta: torch.Tensor, lr: float, mu: float
) -> None:
    """In place: ``momentum <- mu momentum + delta``; ``params -= lr (delta + mu momentum)``."""
    ### BEGIN SOLUTION TODO(task 1): the Nesterov outer step, in place
    momentum.mul_(mu).add_(delta)
    params.sub_(lr * (delta + mu * momentum))
    ### END SOLUTION


def fragments_due(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments launched after inner step ``step`` (counted from 1), in increasing order."""
    ### BEGIN SOLUTION TODO(task 1): the staggered schedule
    due = []
    for f in range(fragments):
        offset = (f + 1) * inner_steps // fragments
        if step >= offset and (step - offset) % inner_steps == 0:
            due.append(f)
    return due
    ### END SOLUTION


# --- task 2: Streaming DiLoCo's synchronisation -------------------------------------------------
class StreamingSync:
    """Streaming DiLoCo's outer loop over ``params`` (this worker's, trained by someone else).

    Call ``after_inner_step()`` once after every inner step, ``flush()`` once after the last.
    Every worker starts from the same ``params``; the global copy and the momentum start as
    those values and zeros.
    """

    def __init__(
        self,
        comm: Communicator,
        params: list[torch.Tensor],
        inner_steps: int,
        fragments: int = 1,
        delay: int = 0,
        mix: float = 0.0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
    ) -> None:
        self.comm, self.params = comm, params
        self.inner_steps, self.fragments, self.delay, self.mix = inner_steps, fragments, delay, mix
        self.outer_lr, self.outer_momentum = outer_lr, outer_momentum
        ### BEGIN SOLUTION TODO(task 2): the global copy, the momentum, the fragments, the step count
        self.global_params = self._flat().clone()
        self.momentum = torch.zeros_like(self.global_params)
        self.bounds = fragment_bounds(self.global_params.numel(), fragments)
        self.step = 0
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (apply after, fragment, average)
        ### END SOLUTION

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _write(self, values: torch.Tensor, lo: int) -> None:
        """Copy ``values`` into the flattened parameters' elements lo .. lo + len(values)."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                a, b = max(lo, offset), min(lo + values.numel(), offset + p.numel())
                if a < b:
                    p.view(-1)[a - offset : b - offset].copy_(values[a - lo : b - lo])
                offset += p.numel()

    def after_inner_step(self) -> None:
        """Apply the fragments due now, then launch the fragments due now."""
        ### BEGIN SOLUTION TODO(task 2): apply what is due, launch what is due
        self.step += 1
        for item in [x for x in self.pending if x[0] == self.step]:
            self._apply(item)
        for f in fragments_due(self.step, self.inner_steps, self.fragments):
            lo, hi = self.bounds[f]
            delta = self.global_params[lo:hi] - self._flat()[lo:hi]
            averaged = md.allreduce(self.comm, delta, op="avg")
            item = (self.step + self.delay, f, averaged)
            self.pending.append(item)
            if self.delay == 0:
                self._apply(item)
        ### END SOLUTION

    def _apply(self, item: tuple[int, int, torch.Tensor]) -> None:
        ### BEGIN SOLUTION TODO(task 2): the outer step on the fragment, then the merge
        self.pending.remove(item)
        _, f, averaged = item
        lo, hi = self.bounds[f]
        nesterov_step_(
            self.global_params[lo:hi], self.momentum[lo:hi], averaged, self.outer_lr, self.outer_momentum
        )
        merged = self.mix * self._flat()[lo:hi] + (1 - self.mix) * self.global_params[lo:hi]
        self._write(merged, lo)
        ### END SOLUTION

    def flush(self) -> None:
        """Apply every fragment still in flight, in the order they were launched."""
        ### BEGIN SOLUTION TODO(task 2): the averages still pending
        for item in list(self.pending):
            self._apply(item)
        ### END SOLUTION


# --- task 3: the quorum step's exchange and average ---------------------------------------------
def exchange(
    comm: Communicator, flat: torch.Tensor, members: list[int], me: int, step: int
) -> dict[int, torch.Tensor]:
    """Send ``flat`` to every other member, receive theirs: ``{slot: gradient}`` with our own.

    A dead member's receive or send raises ``PeerError``: survive it (we just do not hold its
    gradient). Use tag ``step + 1``. Bytes out: exactly (k - 1) x ``flat``'s bytes.
    """
    ### BEGIN SOLUTION TODO(task 3): every receive posted before the first send
    others = [m for m in members if m != me]
    buffers = {peer: torch.empty_like(flat) for peer in others}
    receives = {}
    for peer in others:  # every receive first: the peers' sends drain into them as they write
        try:
            receives[peer] = comm.irecv(buffers[peer], peer, tag=step + 1)
        except PeerError:
            continue
    sends = []
    for peer in others:
        try:
            sends.append(comm.isend(flat, peer, tag=step + 1))
        except PeerError:
            continue
    held = {me: flat}
    for peer, work in receives.items():
        try:
            work.wait()
        except PeerError:
            continue  # died before its gradient was all here: we do not hold it
        held[peer] = buffers[peer]
    for work in sends:
        try:
            work.wait()
        except PeerError:
            continue
    return held
    ### END SOLUTION


def average(grads: list[torch.Tensor]) -> torch.Tensor:
    """(g_0 + g_1 + ...) / k over the contributors' gradients, given in slot order, added left to right."""
    ### BEGIN SOLUTION TODO(task 3): the one order every rank and the replay use
    total = torch.zeros_like(grads[0])
    for gradient in grads:  # 0 + g_0 is g_0 exactly: the same bits as starting from g_0
        total.add_(gradient)
    return total.div_(len(grads))
    ### END SOLUTION


# --- task 4: your design for the measured run ---------------------------------------------------
def design() -> dict:
    """Your Streaming DiLoCo for the measured run: ``StreamingSync``'s keywords as a dict.

    The measured test trains a fixed 600-parameter regression on 2 workers (their data differ) with
    your ``StreamingSync`` and ``StreamingSync(comm, params, **design())``, and counts the emulated
    time until the held-out loss first reaches 1.0: inner steps x compute + bytes / (100 Mbit/s) +
    messages x 0.5 ms, from the transport's counters. Data parallel (H = 1, lr 1, momentum 0) does
    not get there in the run's 200 steps; ``a9_run.MEASURED`` is the same run, for you to try.
    """
    ### BEGIN SOLUTION TODO(task 4): choose inner_steps, fragments, delay, mix, outer_lr, outer_momentum
    return {"inner_steps": 50, "fragments": 1, "delay": 0, "mix": 0.0, "outer_lr": 1.4, "outer_momentum": 0.9}
    ### END SOLUTION
