"""The case table of assignment 9 (Streaming DiLoCo's sync, the quorum step). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of ranks,
a JSON spec) and a trusted check of what the ranks report (``reference.py``). pytest runs them
with seed 0; ``grading.py`` with a seed per student: other sizes, rates, schedules and kills --
none of them the public tests'.

* task 1 ``nesterov_step_`` over several rounds (lr/mu pairs including lr 1, mu 0) and
  ``fragments_due`` on a table of (H, F) pairs, F = 1 and F = H included (one process);
* task 2 ``StreamingSync`` on 2 and 3 workers against a one-process simulation, after every inner
  step: DiLoCo (F = 1, tau = 0); several fragments in flight at once (F tau > H) with a mix; and a
  run that ends with averages pending, applied by ``flush``;
* task 3 ``exchange`` and ``average`` inside the library's ``FaultTolerant``, in elastic launches
  over pipes that SIGKILL ranks at points drawn per run (before, in the middle of and after the
  exchange; after the commit), replacements joining; every survivor's parameters and momentum
  bit for bit against a replay of the history; each full exchange's bytes exactly (k - 1) x the
  gradient's; one gradient over a pipe's 1 MiB buffer (sending before receiving deadlocks).
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {"nesterov_step_": 1, "fragments_due": 1, "StreamingSync": 2, "exchange": 3, "average": 3}
# task 4 is StreamingSync measured with the student's design(): test_time_to_target

#: the measured run: a 24 -> 24 linear regression (600 parameters, float64), 2 workers whose data
#: differ (y = x T + rank + noise), batch 32, inner SGD lr 0.1, 200 inner steps, the same for everyone
MEASURED = {
    "seed": 7,
    "inputs": 24,
    "outputs": 24,
    "batch": 32,
    "inner_lr": 0.1,
    "noise": 0.5,
    "steps": 200,
    "target": 1.0,
}
MEASURED_RANKS = 2

TIME_TIERS = Tiers(
    quantity="emulated time to a held-out loss of 1.0 over a 100 Mbit/s link (2 workers)",
    unit=" ms",
    levels=((10.5, 1.0), (16.0, 0.5), (40.0, 0.25)),
    lower_is_better=True,
    baseline="DiLoCo with the paper's outer step (lr 0.7, momentum 0.9): 14.3 ms at H = 50, 15.2 ms at "
    "H = 10; DDP (H = 1) does not reach the target in 200 steps",
)

KILL_POINTS = ("before_allreduce", "mid_exchange", "after_allreduce", "after_report")
ELASTIC_TIMEOUT = 20  # seconds for one elastic run (a loaded one takes ~3): then reported as a deadlock


def outer_spec(seed: int) -> dict:
    rng = random.Random(seed * 1000 + 1)
    outer = [
        {
            "numel": rng.randint(3, 9),
            "rounds": rng.randint(3, 5),
            "lr_mu": [rng.choice((0.5, 0.7, 0.8)), 0.9],
        },
        {"numel": rng.randint(3, 9), "rounds": 3, "lr_mu": [1.0, 0.0]},
        {"numel": rng.randint(3, 9), "rounds": 4, "lr_mu": [rng.choice((0.3, 1.2)), rng.choice((0.5, 0.95))]},
    ]
    h = rng.randint(5, 9)
    schedules = [
        [h, 1, 3 * h],
        [h, rng.randint(2, h - 1), 3 * h + 2],
        [h, h, 2 * h],
        [rng.randint(2, 4), 2, 9],
    ]
    return {"seed": seed * 1000 + 1, "outer": outer, "schedules": schedules}


def streaming_spec(seed: int, base: int, kind: str) -> dict:
    """``diloco``: F = 1, tau = 0; ``overlap``: F tau > H (fragments in flight together), a mix;
    ``pending``: ends with averages in flight, then flush."""
    rng = random.Random(seed * 1000 + base)
    while True:
        h = rng.randint(3, 6)
        spec = {
            "seed": seed * 1000 + base,
            "inputs": rng.randint(2, 4),
            "outputs": rng.randint(1, 3),
            "batch": 4,
            "inner_lr": 0.05,
            "inner_steps": h,
            "fragments": 1,
            "delay": 0,
            "mix": 0.0,
            "outer_lr": rng.choice((0.5, 0.7, 0.9)),
            "outer_momentum": rng.choice((0.8, 0.9)),
            "steps": 3 * h,
            "flush": True,
        }
        if kind != "diloco":
            spec["fragments"] = rng.randint(2, min(h, spec["inputs"] * spec["outputs"] + spec["outputs"]))
            spec["delay"] = rng.randint(1, h - 1)
            spec["mix"] = rng.choice((0.0, 0.3, 0.5)) if kind == "pending" else rng.choice((0.25, 0.5))
            spec["steps"] = rng.randint(2 * h, 3 * h + 2)
        fine = True
        if kind == "overlap":  # something is always in flight: no flush here (pending's test has it)
            spec["flush"] = False
            fine = spec["fragments"] * spec["delay"] > h
        if kind == "pending":
            fine = ref.simulate(dict(spec, flush=False), 2)["pending_at_end"] > 0
        if fine:
            return spec


def quorum_spec(seed: int, base: int, large: bool) -> dict:
    rng = random.Random(seed * 1000 + base)
    ranks, steps = 3, 6 if not large else 3
    inputs, outputs = (rng.randint(4, 8), rng.randint(2, 4)) if not large else (400, 400 + rng.randint(0, 20))
    kills = []
    if large:  # one death in the middle of the exchange; no replacement: the last steps at 2
        kills.append([rng.randrange(ranks), 0, "mid_exchange", 1])
        restarts = 0
    else:
        first = rng.sample(range(ranks), 2)
        kills.append([first[0], 0, rng.choice(KILL_POINTS[:2]), rng.randint(0, 1)])
        kills.append([first[1], 0, rng.choice(KILL_POINTS), rng.randint(3, 4)])
        restarts = 2
    return {
        "seed": seed * 1000 + base,
        "ranks": ranks,
        "steps": steps,
        "inputs": inputs,
        "outputs": outputs,
        "batch": 3,
        "lr": 0.1,
        "mu": 0.9,
        "kills": kills,
        "min_size": 2,
        "max_restarts": restarts,
        "timeout": ELASTIC_TIMEOUT,
    }


def cases(seed: int) -> list[Case]:
    outer = outer_spec(seed)
    diloco = streaming_spec(seed, 2, "diloco")
    overlap = streaming_spec(seed, 3, "overlap")
    pending = streaming_spec(seed, 4, "pending")
    kills, large = quorum_spec(seed, 5, False), quorum_spec(seed, 6, True)
    return [
        Case(
            "test_outer_step_and_schedule",
            8,
            "nesterov_step_",
            "outer_and_schedule",
            1,
            [outer],
            ref.check_outer_and_schedule(outer),
        ),
        Case(
            "test_streaming[2-diloco]",
            6,
            "StreamingSync",
            "streaming",
            2,
            [diloco],
            ref.check_streaming(diloco, 2),
        ),
        Case(
            "test_streaming[3-overlap]",
            8,
            "StreamingSync",
            "streaming",
            3,
            [overlap],
            ref.check_streaming(overlap, 3),
        ),
        Case(
            "test_streaming[2-pending-flush]",
            6,
            "StreamingSync",
            "streaming",
            2,
            [pending],
            ref.check_streaming(pending, 2),
        ),
        Case("test_quorum[3-kills]", 12, "exchange", "quorum", 1, [kills], ref.check_quorum(kills)),
        Case(
            "test_quorum[3-large-mid-exchange]", 10, "exchange", "quorum", 1, [large], ref.check_quorum(large)
        ),
        Case(
            "test_time_to_target[2-shm]",
            10,
            "StreamingSync",
            "measured",
            MEASURED_RANKS,
            [dict(MEASURED)],
            ref.check_measured(MEASURED, MEASURED_RANKS),
            tiers=TIME_TIERS,
        ),
    ]
