"""Assignment 5, part 2: pipeline schedules, and the step that runs one stage of one.

A model cut into p stages (rank r runs stage r) trains on a batch split into m microbatches.
A schedule is, for every stage, the list of its actions in order: ``("F", j)`` runs the forward
of microbatch j, ``("B", j)`` its backward. A schedule may also split a backward in two, as
zero-bubble pipelines do: ``("B", j)`` then computes only the gradient of the stage's input
(what the stage before waits for) and ``("W", j)``, which may come later, the gradients of the
stage's weights (what nobody waits for). GPipe (given) does every forward, then every backward.

Read: lecture 7, section 4 (the bubble, the activations a stage holds, 1F1B); Narayanan et
al. 2021, "Efficient large-scale language model training on GPU clusters using Megatron-LM",
section 2.2; Qi et al. 2024, "Zero bubble pipeline parallelism" (ICLR), sections 2-3.

=====  ==========================  ==============================================================
task   where                       what it does
=====  ==========================  ==============================================================
4      ``one_f_one_b``,            1F1B; then a schedule of your own design that beats it while
       ``fast_schedule``           no stage holds more than p microbatches (measured, in tiers)
5      ``run_stage``               one stage's actions over point-to-point messages; loss, peak
=====  ==========================  ==============================================================

The library's pipeline (``minidist.parallel.pipeline``) is off limits, and so are
``torch.distributed``'s; ``comm.send``/``comm.recv`` are yours to use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Action", "StageResult", "fast_schedule", "gpipe", "one_f_one_b", "run_stage"]

Action = tuple[str, int]  # ("F", j), ("B", j) or ("W", j): j is the microbatch


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


# --- task 4: schedules -------------------------------------------------------------------------
def one_f_one_b(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B (PipeDream-Flush): the schedule that starts every backward as early as the memory
    it may hold allows.

    Contract: one list per stage (p = ``stages``, m = ``microbatches``), each holding every
    ``("F", j)`` and ``("B", j)`` once, forwards and backwards each in microbatch order. Stage r
    may hold at most min(p - r, m) microbatches (forwarded, not yet backwarded); at each step it
    runs its next forward while it holds fewer than that and has forwards left, and otherwise its
    next backward. ValueError for p < 1 or m < 1 (``_check_sizes``).

    Cost (F = 1 unit, B = 2): the bubble, the idle share of p x the step's time, is
    (p - 1) / (m + p - 1), the same as GPipe's; stage r holds p - r microbatches at its peak
    where GPipe holds m. Read: lecture 7, section 4; Narayanan et al. 2021, section 2.2.

    Questions: why may the last stage hold only one microbatch, and why does stage r need p - r
    to never wait for work? When m < p, what does the cap become?

    >>> one_f_one_b(2, 3)[1]
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    """
    _check_sizes(stages, microbatches)
    # TODO(task 4): 1F1B as lists of actions.
    ### BEGIN SOLUTION TODO(task 4): write one_f_one_b
    schedule = []
    for stage in range(stages):
        warmup = min(stages - 1 - stage, microbatches)
        actions: list[Action] = [("F", j) for j in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", j) for j in range(microbatches - warmup, microbatches)]
        schedule.append(actions)
    return schedule
    ### END SOLUTION


def fast_schedule(stages: int, microbatches: int) -> list[list[Action]]:
    """A schedule of your own design for p = ``stages`` and m = ``microbatches`` that takes less
    time than 1F1B and holds at most p microbatches on every stage.

    Contract: one list per stage; on every stage each forward once and each backward once,
    forwards and backwards (``B``) each in microbatch order; a backward may be split into its
    input part ``("B", j)`` and its weight part ``("W", j)`` (any order among the Ws). Held: a
    microbatch from its forward until its backward is done (both parts, when split).
    ``run_stage`` must run it.

    Measured (a hidden test graded in tiers): your ``run_stage`` runs
    it on 4 stages and 8 microbatches on the grader's stages, which log every forward, B and W as
    it runs and count what each stage holds (more than p: no points). The order they logged is
    timed on the emulated clock, where a forward, a B and a W each take one unit (each does the
    stage's matmul FLOPs once; a whole backward takes two) and messages take none, against the
    ideal 3m (no idle time). 1F1B takes 1 + (p - 1)/m = 1.375x; the tiers are in the README.

    Questions: in 1F1B, what is stage 0 doing while the first gradient comes back? Which part of
    a backward does the stage before wait for, and which part could wait? What can the last
    stages do with the memory that 1F1B leaves them (p - r of p)? What is the least time any
    schedule can take, given when the last stage can start? Draw your schedule
    (``a5_run.timeline``) before you run it.
    """
    _check_sizes(stages, microbatches)
    # TODO(task 4): a schedule of your own that beats 1F1B under a cap of p per stage.
    ### BEGIN SOLUTION TODO(task 4): write fast_schedule
    # Zero bubble's H1 (Qi et al. 2024). The input part of a backward is on the critical path
    # (the stage before waits for it); the weight part is not. Stage r runs p - r forwards before
    # its first backward, as 1F1B does; then, for each microbatch k, its B, the W of microbatch
    # k - r and the next forward. Stage r's last B ends r units before stage 0's (the gradient
    # still has r stages to go), so it holds r Ws back to fill that time; it then holds
    # p - r + r = p microbatches. With F = B = W it idles p - 1 units per stage when m >= p:
    # 1 + (p - 1)/(3m), the least possible (the last stage cannot start before p - 1 units).
    schedule = []
    for stage in range(stages):
        forwards = min(stages - stage, microbatches)
        actions = [("F", j) for j in range(forwards)]
        weights = 0
        for k in range(microbatches):
            actions.append(("B", k))
            if k >= stage:
                actions.append(("W", k - stage))
                weights += 1
            if forwards < microbatches:
                actions.append(("F", forwards))
                forwards += 1
        actions += [("W", j) for j in range(weights, microbatches)]
        schedule.append(actions)
    return schedule
    ### END SOLUTION


# --- task 5: running one stage ----------------------------------------------------------------
@dataclass
class StageResult:
    """What ``run_stage`` returns on each rank.

    loss: the mean over microbatches of ``loss_fn`` (a float) on the last stage, None elsewhere.
    peak_in_flight: the largest number of microbatches whose forward this stage had run and
    whose backward it had not finished (both parts, when split): their activations were held.
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
    """Run this rank's ``actions`` (``schedule[comm.rank]``) for ``stage``: rank r is stage r of
    p = ``comm.world_size``; m, the number of microbatches, is the number of forwards in ``actions``.

    Contract:

    * the result equals one process: the last stage's loss is the mean of ``loss_fn(out,
      targets[j])`` over the microbatches, and the gradients that accumulate in the stage's
      parameters are those of that mean (the caller zeroes them);
    * stage 0 reads ``inputs[j]``, the last stage ``targets[j]`` (others may get None); every
      activation and gradient between stages has ``activation_shape`` (float32);
    * exactly one message per microbatch and stage boundary in each direction: its activation to
      rank r + 1, the gradient of its input to rank r - 1 (``comm.send``/``comm.recv``), nothing
      else;
    * the work runs in the order of ``actions``: ``("F", j)``, the forward; ``("B", j)``, the whole
      backward -- or, when ``actions`` also holds ``("W", j)``, only the gradient of the stage's
      input, with the weights' gradients left to ``("W", j)``. Autograd computes only what leads
      to the tensors you ask for (``torch.autograd.backward(..., inputs=...)``): the input for B,
      ``list(stage.parameters())`` for W;
    * only call ``stage`` (``stage(x)``): the grader's stage counts the forwards, Bs and Ws that go
      through it and shows no submodule and no parameter but the one W asks for.

    Cost: a stage holds a microbatch's activations from its forward until its backward is done
    (both parts, when split): ``peak_in_flight``.

    Questions: what must a stage keep between a forward and its backward, and between a B and its
    W -- and what tells autograd to keep its graph after B? What does stage 0's input need so
    that B can ask for its gradient? Where does the 1/m of the mean loss enter, and only once?
    """
    # TODO(task 5): run the actions; count what is held.
    ### BEGIN SOLUTION TODO(task 5): write run_stage
    rank, p = comm.rank, comm.world_size
    first, last = rank == 0, rank == p - 1
    m = sum(1 for kind, _ in actions if kind == "F")
    split = {j for kind, j in actions if kind == "W"}
    shape = tuple(activation_shape)
    kept: dict[int, list] = {}  # j -> [input, output (or loss / m), gradient of the output]
    losses: list[float] = []
    peak = 0
    for kind, j in actions:
        if kind == "F":
            # every input requires a gradient (stage 0's is a detached copy), so that B can ask
            # for the input's gradient alone
            x = inputs[j].detach() if first else comm.recv(torch.empty(shape), src=rank - 1)
            x.requires_grad_()
            out = stage(x)
            if last:
                loss = loss_fn(out, targets[j])
                losses.append(float(loss.detach()))
                kept[j] = [x, loss / m, None]
            else:
                comm.send(out.detach().contiguous(), dst=rank + 1)
                kept[j] = [x, out, None]
            peak = max(peak, len(kept))
        elif kind == "B":
            x, out, _ = kept[j]
            grad = None if last else comm.recv(torch.empty(shape), src=rank + 1)
            if j in split:  # the input's gradient only; the graph stays for W
                torch.autograd.backward(out, grad, inputs=[x], retain_graph=True)
                kept[j][2] = grad
            else:
                torch.autograd.backward(out, grad)
                del kept[j]
            if not first:
                comm.send(x.grad.contiguous(), dst=rank - 1)
        elif kind == "W":
            _, out, grad = kept.pop(j)
            torch.autograd.backward(out, grad, inputs=list(stage.parameters()))
        else:
            raise ValueError(f"unknown action {kind!r}: expected 'F', 'B' or 'W'")
    return StageResult(sum(losses) / len(losses) if last and losses else None, peak)
    ### END SOLUTION
