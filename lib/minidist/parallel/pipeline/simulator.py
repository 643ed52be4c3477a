"""Check a schedule and simulate it: the dependencies between stages, deadlocks, a timeline.

``schedules`` gives each stage a list of actions; this module runs those lists the way the
executor (``executor.run_pipeline``) will: sends are buffered (the stage goes on), receives
block until the message has arrived. A forward on (virtual) stage s waits for the forward on
s - 1, a backward for the backward on s + 1 and for its own forward. ``check_schedule`` refuses
a schedule that misses or repeats an action or would deadlock, so a schedule that passes the
checker runs. (With sends that wait for their receiver, plain 1F1B would deadlock at once for
p = 2: stage 0 sends F1 while stage 1 sends the gradient of B0, each waiting for the other to
receive; Megatron pairs such a send and receive in one batched call.) ``simulate`` runs the
same lists on an ideal machine (no communication time) and returns a ``Timeline`` whose
``bubble_fraction`` is compared with ``schedules.bubble_formula``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .schedules import Action

__all__ = ["ScheduleError", "Timeline", "check_schedule", "simulate"]


class ScheduleError(ValueError):
    """A schedule misses an action, repeats one, breaks a dependency or deadlocks."""


def _normalise(schedule: Sequence[Sequence[Sequence]]) -> tuple[int, int, list[list[Action]]]:
    """(stages, chunks, schedule with every action as (kind, mb, chunk))."""
    out = []
    for r, actions in enumerate(schedule):
        row = []
        for a in actions:
            if len(a) not in (2, 3) or a[0] not in ("F", "B"):
                raise ScheduleError(f"stage {r}: action {a!r} is not ('F' or 'B', microbatch[, chunk])")
            row.append((a[0], int(a[1]), int(a[2]) if len(a) == 3 else 0))
        out.append(row)
    chunks = 1 + max((a[2] for row in out for a in row), default=0)
    return len(out), chunks, out


def _dependencies(action: Action, stage: int, p: int, v: int) -> list[tuple[int, Action]]:
    """The (stage, action) pairs that must finish before ``action`` on ``stage`` may start.

    Virtual stage s = chunk * p + stage. F on s needs F on s - 1 (its input); B on s needs
    B on s + 1 (its output gradient) and F on s (its saved activations).
    """
    kind, mb, chunk = action
    s = chunk * p + stage
    if kind == "F":
        return [] if s == 0 else [((s - 1) % p, ("F", mb, (s - 1) // p))]
    deps = [(stage, ("F", mb, chunk))]
    if s < p * v - 1:
        deps.append(((s + 1) % p, ("B", mb, (s + 1) // p)))
    return deps


def _name(action: Action, v: int) -> str:
    kind, mb, chunk = (*action, 0)[:3]
    return f"{kind}{mb}" + (f".{chunk}" if v > 1 else "")


def _run_order(schedule, t_forward: float, t_backward: float, check: bool, microbatches: int | None):
    """Execute every stage's list in order (receives block, sends do not); return start/end times.

    Each action starts when its stage is free and its dependencies have finished; a stage whose
    next action waits on something that never happens is a deadlock, reported by name.
    """
    p, v, sched = _normalise(schedule)
    if not p:
        raise ScheduleError("the schedule has no stages: pass one list of actions per stage")
    if check:
        m = microbatches
        for r, actions in enumerate(sched):
            seen = set()
            for a in actions:
                if a in seen:
                    raise ScheduleError(f"stage {r}: {_name(a, v)} appears twice")
                if not 0 <= a[1] < m:
                    raise ScheduleError(
                        f"stage {r}: {_name(a, v)} names microbatch {a[1]}, not in 0..{m - 1}"
                    )
                seen.add(a)
            for kind in ("F", "B"):
                for c in range(v):
                    for mb in range(m):
                        if (kind, mb, c) not in seen:
                            raise ScheduleError(f"stage {r}: {_name((kind, mb, c), v)} is missing")
        for r, actions in enumerate(sched):
            done_here = set()
            for a in actions:
                if a[0] == "B" and ("F", a[1], a[2]) not in done_here:
                    raise ScheduleError(f"stage {r}: {_name(a, v)} comes before its own forward")
                done_here.add(a)
    durations = {"F": t_forward / v, "B": t_backward / v}
    end: dict[tuple[int, Action], float] = {}
    starts: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    free = [0.0] * p
    remaining = sum(len(a) for a in sched)
    while remaining:
        progressed = False
        for r in range(p):
            while position[r] < len(sched[r]):
                a = sched[r][position[r]]
                deps = _dependencies(a, r, p, v)
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                finish = start + durations[a[0]]
                end[(r, a)] = finish
                free[r] = finish
                starts[r].append((schedule[r][position[r]], start, finish))  # the caller's action
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for r in range(p):
                if position[r] < len(sched[r]):
                    a = sched[r][position[r]]
                    missing = [
                        f"{_name(d, v)} on stage {s}"
                        for s, d in _dependencies(a, r, p, v)
                        if (s, d) not in end
                    ]
                    stuck.append(f"stage {r} waits in {_name(a, v)} for {', '.join(missing)}")
            raise ScheduleError("deadlock: " + "; ".join(stuck))
    return p, v, starts


def check_schedule(schedule: Sequence[Sequence[Sequence]], microbatches: int) -> None:
    """Raise ``ScheduleError`` naming the first violation, else return None.

    Checks, in this order: every stage runs each (F, mb[, chunk]) and (B, mb[, chunk]) exactly
    once; no backward before its own forward on the same stage; and that executing each
    stage's list in order, with blocking receives and buffered sends, finishes (a forward on
    stage s waits for the forward on s - 1, a backward for the backward on s + 1). Any
    schedule that passes also respects the cross-stage orders, since it ran.
    """
    _run_order(schedule, 1.0, 2.0, check=True, microbatches=microbatches)


@dataclasses.dataclass
class Timeline:
    """Per stage, the (action, start, end) of every action, in execution order."""

    stages: list[list[tuple[Action, float, float]]]
    chunks: int = 1

    @property
    def makespan(self) -> float:
        return max(end for row in self.stages for _, _, end in row) - min(
            start for row in self.stages for _, start, _ in row
        )

    @property
    def busy(self) -> list[float]:
        return [sum(end - start for _, start, end in row) for row in self.stages]

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-time / (stages x makespan)."""
        return 1.0 - sum(self.busy) / (len(self.stages) * self.makespan)


def simulate(schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Run the schedule on an ideal machine (no communication time); each chunk costs t / chunks."""
    _, v, starts = _run_order(schedule, t_forward, t_backward, check=False, microbatches=None)
    return Timeline(starts, v)
