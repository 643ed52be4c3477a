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
    raise NotImplementedError("TODO(task 1): the Nesterov outer step, in place")


def fragments_due(step: int, inner_steps: int, fragments: int) -> list[int]:
    """The fragments launched after inner step ``step`` (counted from 1), in increasing order."""
    raise NotImplementedError("TODO(task 1): the staggered schedule")


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
        raise NotImplementedError(
            "TODO(task 2): the global copy, the momentum, the fragments, the step count"
        )

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
        raise NotImplementedError("TODO(task 2): apply what is due, launch what is due")

    def _apply(self, item: tuple[int, int, torch.Tensor]) -> None:
        raise NotImplementedError("TODO(task 2): the outer step on the fragment, then the merge")

    def flush(self) -> None:
        """Apply every fragment still in flight, in the order they were launched."""
        raise NotImplementedError("TODO(task 2): the averages still pending")


# --- task 3: the quorum step's exchange and average ---------------------------------------------
def exchange(
    comm: Communicator, flat: torch.Tensor, members: list[int], me: int, step: int
) -> dict[int, torch.Tensor]:
    """Send ``flat`` to every other member, receive theirs: ``{slot: gradient}`` with our own.

    A dead member's receive or send raises ``PeerError``: survive it (we just do not hold its
    gradient). Use tag ``step + 1``. Bytes out: exactly (k - 1) x ``flat``'s bytes.
    """
    raise NotImplementedError("TODO(task 3): every receive posted before the first send")


def average(grads: list[torch.Tensor]) -> torch.Tensor:
    """(g_0 + g_1 + ...) / k over the contributors' gradients, given in slot order, added left to right."""
    raise NotImplementedError("TODO(task 3): the one order every rank and the replay use")


# --- task 4: your design for the measured run ---------------------------------------------------
def design() -> dict:
    """Your Streaming DiLoCo for the measured run: ``StreamingSync``'s keywords as a dict.

    The measured test trains a fixed 600-parameter regression on 2 workers (their data differ) with
    your ``StreamingSync`` and ``StreamingSync(comm, params, **design())``, and counts the emulated
    time until the held-out loss first reaches 1.0: inner steps x compute + bytes / (100 Mbit/s) +
    messages x 0.5 ms, from the transport's counters. Data parallel (H = 1, lr 1, momentum 0) does
    not get there in the run's 200 steps; ``a9_run.MEASURED`` is the same run, for you to try.
    """
    raise NotImplementedError(
        "TODO(task 4): choose inner_steps, fragments, delay, mix, outer_lr, outer_momentum"
    )
