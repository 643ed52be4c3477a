"""Fault-tolerant, elastic data parallelism: a quorum per step, live recovery from a healthy peer.

::

    from minidist.parallel import elastic

    def worker(comm, steps):
        torch.manual_seed(0)                              # every rank builds the same model
        model, opt = make_model(), torch.optim.Adam(...)
        ft = elastic.FaultTolerant(comm, model, opt, total_steps=steps)
        while ft.step < steps:
            ft.train_step(lambda step: loss_fn(model, batch(comm.rank, step)))
        return ft.history                                 # who contributed to each step

    md.launch(worker, world_size=4, args=(100,), transport="pipe",
              elastic=elastic.Policy(min_size=2, max_restarts=2))

Plain data parallelism stops when one rank dies: the others wait in an allreduce that never
completes (or the launcher kills them all). Here a rank may die at any point, and training goes
on among the survivors; with ``max_restarts`` a replacement process joins and is brought up to
date by a healthy peer -- no checkpoint is read. The same idea as PyTorch's torchft (a
"lighthouse" that forms a quorum per step), written on the library's pipes.

The pieces:

- a **coordinator** (``coordinator.py``) in the launcher process: each step every live rank asks
  it for the quorum (the members and the step number); it answers when every live rank has
  asked, and after the gradient exchange it decides which gradients count;
- the **fault-tolerant step** (``step.py``): every member sends its gradient to every other
  member, receives theirs (a dead peer's pipe reports end-of-file: no timeout), reports what it
  received, and applies the average over the *contributors* the coordinator commits --
  summed in slot order, so the result is bit-for-bit a one-process replay of the same history;
- the **launcher** (``launcher.py``, behind ``md.launch(..., elastic=Policy(...))``): starts the
  ranks, runs the coordinator in its wait loop, and starts a replacement when a rank dies;
- the **replay** (``replay.py``): ``replay(history, make_model, loss_of)`` trains one model in
  one process through the same membership history -- the reference a run must equal bit for bit.

A timeline (4 ranks, slot 1 is SIGKILLed in the middle of step 2's exchange)::

    step 2  quorum {0,1,2,3}  ->  each sends its gradient to the others
            slot 1 sent to slot 0, then died     slots 2, 3: recv from 1 -> EOF (PeerError)
            reports: 0 got {0,1,2,3}, 2 got {0,2,3}, 3 got {0,2,3}
            commit: contributors = {0,2,3} (what *every* survivor holds): all apply
                    (g0 + g2 + g3) / 3 -- slot 0 drops the g1 it had
            launcher: slot 1's process ended -> start slot 1, incarnation 1 (a replacement)
    step 3  quorum {0,1,2,3}, joiner 1, donor 0 (the lowest healthy slot): a recovery round
            the coordinator hands each pair (1, k) a fresh pair of pipes (passed as file
            descriptors over the control socket); slot 0 sends the model, the optimizer state,
            the step and the history to slot 1; commit: slot 1 recovered
    step 3  quorum {0,1,2,3}: a training round at N = 4 again

Detection needs no timeout: a killed process's pipes are closed by the kernel, so a survivor's
read of it ends with end-of-file at once and a write with a broken pipe; the coordinator sees
the process end (its sentinel). A death is thus detected within the step in which it happens.
A rank that dies *after* its gradient reached every survivor still counts as a contributor.
Measured (tests/lib/parallel/test_elastic.py, 4 kills in training rounds, 11 survivor commits,
4 ranks of a tiny model on a 2-core machine, six runs): from the SIGKILL to a survivor's commit
of that step 5-19 ms (16-41 ms with three CPU-bound processes beside it).

A rank that is alive but stuck (a hang, SIGSTOP, an endless loop) keeps its pipes open, so
nobody sees end-of-file: its peers wait in their receives and the coordinator for its report.
By default (``Policy(step_timeout=None)``) nothing detects it and the run ends with
``LaunchTimeout`` (md.launch's ``timeout``), naming the ranks and their stacks. With
``Policy(step_timeout=s)`` (torchft's quorum timeout, in our terms): a receive gives up on a peer
after s seconds (its gradient is then not held), so the others report; the coordinator kills a
member still silent s seconds after every other member of the phase has spoken, and from then
on it is a death like any other (a replacement may take the slot). A hang thus costs about 2 s:
measured 2.02-2.04 s from the hang to the survivors' commit at s = 1 (three runs). s must exceed
the spread of the ranks' step times (compute, exchange, a recovery's state): a rank that slow is
killed as stuck. Both are tested. A process that hangs *before* its first ask (a replacement
stuck in its setup) is not a member yet, so ``step_timeout`` does not see it: the quorum waits
for it (or, without ``wait_for_replacements``, the launch waits for it at the end).
``Policy(start_timeout=s)`` kills a rank that has not asked within s seconds of its start (tested:
a replacement that hangs at startup is killed, the next one recovers).

Cost per training step: each member sends its gradient to k - 1 peers, (k - 1) x the gradient's
bytes (an all-gather, not a ring allreduce: k / 2 times the bytes of a ring, the price of a
fixed summation order that a replay reproduces); 2 small control messages per rank per step.

Only the pipe transport: shared memory has no end-of-file (a dead peer looks like a slow one);
the torch transport would need a new process group per quorum (torchft's way).
``from minidist.parallel import elastic`` loads this package; md.launch never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .coordinator import ElasticError
from .replay import replay
from .step import FaultTolerant, average_in_order, identity


@dataclass(frozen=True)
class Policy:
    """What ``md.launch(..., elastic=Policy(...))`` tolerates.

    Args:
        min_size: the fewest ranks a quorum may have; below it the launch fails (ElasticError).
        max_restarts: how many replacement processes may be started in all (0: none; the
            survivors go on at N - 1, N - 2, ... down to ``min_size``).
        wait_for_replacements: True (default): the next quorum waits for a replacement that
            is starting, so the membership history does not depend on timing; False: the
            survivors go on and the replacement joins the first quorum after it has asked
            (torchft's way: no time lost waiting for a process to start).
        step_timeout: None (default): only deaths are detected, a stuck rank ends the launch
            in LaunchTimeout; seconds: a receive gives up on a peer after that long, and a member
            still silent that long after all others spoke is killed (then handled as a death):
            a hang costs about 2 x step_timeout. Choose it above a step's compute + exchange.
        start_timeout: None (default): a rank that never asks for its first quorum (stuck in its
            setup: loading data, building the model) is waited for, and ends the launch in
            LaunchTimeout; seconds: a rank, started with the launch or a replacement, that has
            not asked within that long of its start is killed (then handled as a death). Choose
            it above a process's start and setup. ``step_timeout`` does not cover this: a
            process still starting is not a member yet.
    """

    min_size: int = 1
    max_restarts: int = 0
    wait_for_replacements: bool = True
    step_timeout: float | None = None
    start_timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("min_size", "max_restarts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (name == "min_size"):
                raise ValueError(
                    f"Policy({name}=...) must be an int >= {int(name == 'min_size')}, got {value!r}"
                )
        for name in ("step_timeout", "start_timeout"):
            timeout = getattr(self, name)
            if timeout is not None and (
                isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
            ):
                raise ValueError(f"Policy({name}=...) must be None or seconds > 0, got {timeout!r}")

    def _launch(self, fn, world_size: int, args: tuple, kwargs: dict, **options) -> list:
        """Called by ``md.launch`` (which does not import this package): see ``launcher.py``."""
        from .launcher import launch_elastic

        return launch_elastic(self, fn, world_size, args, kwargs, **options)


__all__ = ["ElasticError", "FaultTolerant", "Policy", "average_in_order", "identity", "replay"]
