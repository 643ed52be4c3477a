"""Assignment 5, part 2: the 1F1B pipeline schedule and the step that runs one stage of it.

A model cut into p stages (rank r runs stage r) trains on a batch split into m microbatches.
A schedule is, for every stage, the list of its actions in order: ``("F", j)`` runs the forward
of microbatch j, ``("B", j)`` its backward. GPipe (given) does every forward, then every
backward; stage r then holds the activations of all m microbatches at once. 1F1B (PipeDream-
Flush, Narayanan et al. 2021) starts backwards as early as possible, so stage r holds at most
``p - r``. p = 4 stages, m = 6 microbatches; a forward takes 1 time unit (digit: the
microbatch), a backward 2 (letter: a = microbatch 0, b = 1, ...), ``.`` is idle::

    GPipe     012345.........aabbccddeeff        1F1B      0123......aa4bb5cc.dd.ee.ff
              .012345......aabbccddeeff..                  .012....aa3bb4cc5dd.ee.ff..
              ..012345...aabbccddeeff....                  ..01..aa2bb3cc4dd5ee.ff....
              ...012345aabbccddeeff......                  ...0aa1bb2cc3dd4ee5ff......
    held      6, 6, 6, 6 microbatches                      4, 3, 2, 1

Both have the same bubble, (p - 1) / (m + p - 1) of the time idle (3/9 here); 1F1B's gain is
memory.

=====  ========================  ================================================================
task   where                     what it does
=====  ========================  ================================================================
6      ``one_f_one_b``           the 1F1B schedule as lists of actions
7      ``run_stage``             one stage's actions over point-to-point messages; loss, peak
=====  ========================  ================================================================

The library's pipeline (``minidist.parallel.pipeline``) is off limits, and so are
``torch.distributed``'s; ``comm.send``/``comm.recv`` are yours to use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Action", "StageResult", "gpipe", "one_f_one_b", "run_stage"]

Action = tuple[str, int]  # ("F", microbatch) or ("B", microbatch)


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1 or microbatches < 1:
        raise ValueError(f"need at least 1 stage and 1 microbatch, got {stages} and {microbatches}")


# --- given: GPipe ---------------------------------------------------------------------------
def gpipe(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every stage does the m forwards, then the m backwards in the same order.

    >>> gpipe(2, 2)
    [[('F', 0), ('F', 1), ('B', 0), ('B', 1)], [('F', 0), ('F', 1), ('B', 0), ('B', 1)]]
    """
    _check_sizes(stages, microbatches)
    one = [("F", j) for j in range(microbatches)] + [("B", j) for j in range(microbatches)]
    return [list(one) for _ in range(stages)]


# --- task 6: 1F1B ---------------------------------------------------------------------------
def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: stage r (of p = ``stages``; m = ``microbatches``) does, in this order,

    * warm-up: ``w = min(p - 1 - r, m)`` forwards, of microbatches 0 .. w-1;
    * steady state, for i = 0 .. m - w - 1: the forward of microbatch w + i, then the backward
      of microbatch i;
    * cool-down: the backwards of microbatches m - w .. m - 1.

    Every microbatch's forward and backward once; backwards in the order of the forwards. The
    last stage (w = 0) alternates F j, B j from the start. ValueError for p < 1 or m < 1.

    >>> first, last = one_f_one_b(2, 3)
    >>> first
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> last
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    """
    _check_sizes(stages, microbatches)
    # TODO(task 6): one list per stage, three loops.
    raise NotImplementedError("TODO(task 6): write one_f_one_b")


# --- task 7: running one stage ----------------------------------------------------------------
@dataclass
class StageResult:
    """What ``run_stage`` returns on each rank.

    loss: the mean over microbatches of ``loss_fn`` (a float) on the last stage, None elsewhere.
    peak_in_flight: the largest number of microbatches whose forward this stage had run and
    whose backward it had not (their activations were held), at any moment.
    """

    loss: float | None
    peak_in_flight: int


def run_stage(
    stage: nn.Module,
    comm,
    actions: Sequence[Action],
    inputs: Sequence[torch.Tensor] | None,
    targets: Sequence[torch.Tensor] | None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int],
) -> StageResult:
    """Run this rank's ``actions`` (``schedule[comm.rank]``) for ``stage``; rank r is stage r of
    p = ``comm.world_size``; m, the number of microbatches, is the number of forwards in ``actions``.

    ``("F", j)``:
      * the input: stage 0 takes ``inputs[j]``; stage r > 0 receives it from rank r - 1
        (``comm.recv`` into ``torch.empty(activation_shape)``, float32) and marks it
        ``requires_grad_()`` (its gradient is what goes back);
      * ``out = stage(input)``;
      * not the last stage: send ``out`` (detached) to rank r + 1; the last stage computes
        ``loss_fn(out, targets[j])`` instead;
      * keep what the backward needs (input and out, or the loss) until ``("B", j)``.
    ``("B", j)``:
      * the last stage: backward of ``loss / m`` (so that the parameters' gradients add up to
        those of the mean loss over the whole batch); any other stage receives the gradient of
        ``out`` from rank r + 1 (``activation_shape``) and calls ``out.backward(grad)``;
      * stage r > 0 sends the input's ``.grad`` to rank r - 1;
      * drop what was kept for j.

    Exactly one message per microbatch and stage boundary in each direction (one send of an
    activation forward, one of a gradient backward), nothing else. Gradients accumulate in the
    stage's parameters (the caller zeroes them). Only call ``stage`` (``stage(x)``): the
    grader's stage counts the forwards and backwards that go through it and shows no parameters
    or submodules. ``inputs`` is used by stage 0 only and ``targets`` by the last only (others
    may pass None); the activations between stages all have ``activation_shape``.
    """
    # TODO(task 7): a dict microbatch -> what is kept; count its size after every forward.
    raise NotImplementedError("TODO(task 7): write run_stage")
