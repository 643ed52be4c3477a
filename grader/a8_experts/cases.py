"""The case table of assignment 8 (a mixture of experts over the ranks). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of
ranks, a JSON spec) and a trusted check of what the ranks report (``reference.py``). pytest runs
them with seed 0; ``grading.py`` with a seed per student: other shapes, piece sizes, numbers of
tokens, experts, top-k, capacity factors and routers -- none of them the public tests'.

* task 1 ``all_to_all``: equal pieces of several shapes and dtypes on 3 ranks over pipes, one of
  them larger than a pipe's buffer (sending everything before receiving deadlocks there), each
  call's transport bytes exactly (p-1)/p of the input; uneven pieces (empty ones too) on 4 ranks,
  the sizes exchanged (the pieces for the others + 8 bytes to each) and given (the pieces only);
* task 2 ``route`` (experts, gates and their gradient, slots with the priority rule, capacity
  factors that drop and one that does not; k = 1, 2, 3) and ``dispatch``/``combine`` on a routing
  drawn at random (so a wrong router does not cost these), values and every gradient;
* task 3 ``ExpertParallelMoE``: output and every gradient equal to one process on 2 ranks (shm,
  nothing dropped) and 4 ranks (pipe, with drops, and the last rank's experts chosen by no token:
  that rank receives no rows, and its backward exchanges must run all the same);
* task 4, measured in tiers: the bytes one forward and backward carries per token (``MEASURED``,
  the same for everyone), in rows of d float64s, with the output and gradients checked first.
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {
    "all_to_all": 1,
    "route": 2,
    "dispatch": 2,
    "ExpertParallelMoE": 3,
}  # task 4 is ExpertParallelMoE measured: test_bytes_per_token

#: the measured layer: 8 experts (64 -> 256 -> 64) on 2 ranks, top-4, capacity factor 2 (C = T: nothing
#: is dropped), 64 tokens a rank; a token's 4 experts share a rank more often than not
MEASURED = {
    "experts": 8,
    "top_k": 4,
    "capacity_factor": 2.0,
    "tokens": 64,
    "width": 64,
    "hidden": 256,
    "router_scale": 1.0,
    "seed": 7,
}
MEASURED_RANKS = 2

BYTES_TIERS = Tiers(
    quantity="bytes sent per token, forward and backward, in rows of d float64s",
    unit=" rows",
    levels=((4.6, 1.0), (9.0, 0.5), (17.0, 0.25)),
    lower_is_better=True,
    baseline="the library's ExpertParallelMoE (a row per kept choice): 7.31 rows; GShard's padded layout: 16",
)


def equal_spec(seed: int) -> dict:
    rng = random.Random(seed * 1000 + 1)
    pieces = [
        {"shape": [rng.randint(1, 5), rng.randint(1, 4)], "dtype": "float64"},
        {"shape": [rng.randint(1, 9)], "dtype": "int64"},
        {"shape": [rng.randint(2, 4), rng.randint(1, 3), rng.randint(1, 3)], "dtype": "float32"},
        {"shape": [150_000 + rng.randint(0, 999)], "dtype": "float64"},  # 1.2 MB: over a pipe's buffer
    ]
    return {"seed": seed * 1000 + 1, "pieces": pieces}


def uneven_spec(seed: int, world: int) -> dict:
    rng = random.Random(seed * 1000 + 2)
    rows = [[rng.choice((0, 1, 2, 3, 5, 8)) for _ in range(world)] for _ in range(world)]
    rows[rng.randrange(world)][rng.randrange(world)] = 0  # at least one empty piece
    return {"seed": seed * 1000 + 2, "rows": rows, "trailing": [rng.randint(1, 4), 2]}


def routing_spec(seed: int) -> dict:
    rng = random.Random(seed * 1000 + 3)
    problems = []
    for top_k, factor in ((1, 1.0), (2, 1.25), (3, 0.75), (2, None)):
        experts = rng.randint(max(3, top_k), 8)
        problems.append(
            {
                "tokens": rng.randint(9, 20),
                "experts": experts,
                "top_k": top_k,
                "capacity_factor": factor,
                "scale": rng.choice((1.0, 2.0, 3.0)),
            }
        )
    return {"seed": seed * 1000 + 3, "problems": problems}


def dispatching_spec(seed: int) -> dict:
    rng = random.Random(seed * 1000 + 4)
    problems = []
    for top_k in (1, 2, 3):
        tokens, experts = rng.randint(5, 12), rng.randint(top_k + 1, 6)
        problems.append(
            {
                "tokens": tokens,
                "experts": experts,
                "top_k": top_k,
                "capacity": rng.randint(1, tokens * top_k // experts + 1),
                "width": rng.randint(2, 5),
            }
        )
    return {"seed": seed * 1000 + 4, "problems": problems}


def layer_spec(seed: int, base: int, world: int, factor: float | None, starve: bool = False) -> dict:
    """A layer for ``world`` ranks; with a capacity factor, one whose routing drops choices; with
    ``starve``, one whose last rank's experts no token chooses (that rank receives no rows, and
    its backward exchanges must run all the same)."""
    rng = random.Random(seed * 1000 + base)
    while True:
        spec = {
            "experts": world * rng.randint(1, 2) if world > 2 else 8,
            "top_k": 2,
            "capacity_factor": factor,
            "tokens": rng.randint(5, 9),
            "width": rng.randint(3, 6),
            "hidden": rng.randint(4, 8),
            "router_scale": 3.0 if factor else 1.0,
            "seed": rng.randrange(2**20),
        }
        spec["experts"] = max(spec["experts"], 4)
        if starve:
            local = spec["experts"] // world
            spec["starved"] = list(range(spec["experts"] - local, spec["experts"]))
        if (factor is None or ref.dropped(spec, world) > 0) and ref.starved(spec, world) == starve:
            return spec


def cases(seed: int) -> list[Case]:
    equal = equal_spec(seed)
    uneven = uneven_spec(seed, 4)
    routing, dispatching = routing_spec(seed), dispatching_spec(seed)
    whole, drops = layer_spec(seed, 5, 2, None), layer_spec(seed, 6, 4, 1.0, starve=True)
    return [
        Case(
            "test_exchange_equal[3-pipe]",
            6,
            "all_to_all",
            "exchange_equal",
            3,
            [equal],
            ref.check_equal(equal, 3),
            "pipe",
        ),
        Case(
            "test_exchange_uneven[4-shm]",
            6,
            "all_to_all",
            "exchange_uneven",
            4,
            [uneven],
            ref.check_uneven(uneven),
        ),
        Case("test_routing", 6, "route", "routing", 1, [routing], ref.check_routing(routing)),
        Case(
            "test_dispatching",
            6,
            "dispatch",
            "dispatching",
            1,
            [dispatching],
            ref.check_dispatching(dispatching),
        ),
        Case(
            "test_expert_parallel[2-shm-whole]",
            8,
            "ExpertParallelMoE",
            "expert_parallel",
            2,
            [whole],
            ref.check_expert_parallel(whole, 2),
        ),
        Case(
            "test_expert_parallel[4-pipe-drops]",
            8,
            "ExpertParallelMoE",
            "expert_parallel",
            4,
            [drops],
            ref.check_expert_parallel(drops, 4),
            "pipe",
        ),
        Case(
            "test_bytes_per_token[2-shm]",
            10,
            "ExpertParallelMoE",
            "expert_parallel",
            MEASURED_RANKS,
            [dict(MEASURED)],
            ref.check_bytes(MEASURED, MEASURED_RANKS),
            tiers=BYTES_TIERS,
        ),
    ]
