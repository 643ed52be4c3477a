"""The case table of assignment 5 (tensor-parallel MLP, pipeline schedules, their stage step).

Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of
ranks, JSON arguments) and a trusted check of what the ranks report (``reference.py``: the dense
model in one process, the schedules written again, a brute-force checker and a simulator).
pytest runs them with seed 0; ``grading.py`` runs the same cases with a seed per student (other
sizes, data and models).

* f and g: forward and backward values with rank-dependent inputs and gradients, and exactly one
  allreduce each, in the right direction (tasks 1, 2);
* column- and row-parallel layers on sizes the public tests do not use, with and without bias,
  gather_output and input_is_parallel both ways, every shard nudged by the grader after
  ``load_dense``: output, every shard's gradients, the input's gradient, and each collective's
  input, which must be this rank's share (tasks 1, 2);
* the MLP on 2 and 4 ranks against the dense MLP: output, input gradient, every shard's
  gradient, with the shards nudged, and exactly one allreduce of one activation forward and one
  backward per call, counted by the grader's wrapper of the collectives, each given this rank's
  partial output / partial input gradient (task 3);
* 1F1B: exactly the greedy schedule (``reference.one_f_one_b``); valid by a brute-force checker
  (each action once, dependencies, no deadlock); the simulated bubble equals (p-1)/(m+p-1); at
  most p - r microbatches held on stage r (GPipe holds m) (task 4);
* the stage step on 2, 3 and 4 ranks with the grader's stage modules and the grader's 1F1B,
  GPipe and split-backward schedules: gradients and loss equal one process; the order of the
  work follows the schedule, microbatch by microbatch (B and W apart where it splits them); the
  microbatches held, counted by the grader's stage modules, equal the schedule's and the
  reported peak; exactly one message per microbatch and stage boundary each way, counted per
  peer by the grader's communicator, each the activation or input gradient of its microbatch
  (task 5);
* measured, in tiers (``FAST_TIERS``): the student's ``fast_schedule(4, 8)`` run by the
  student's ``run_stage`` on the grader's stages: right as above, at most p microbatches held on
  every stage (the grader's count), then the order the grader's stages logged, timed on the
  emulated clock (``reference.emulated_time``) over the ideal 3m (tasks 4, 5).

The folder holding the student's ``tp_layers.py`` and ``schedule.py`` must be on PYTHONPATH;
they are imported only in the worker processes. Each ``Case`` carries its points;
``grading.py`` declares the assignment.
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {
    "copy_to_tensor_parallel": 1,  # f, written with the column-parallel layer that uses it
    "ColumnParallelLinear": 1,
    "reduce_from_tensor_parallel": 2,  # g, written with the row-parallel layer that uses it
    "RowParallelLinear": 2,
    "ParallelMLP": 3,
    "one_f_one_b": 4,
    "fast_schedule": 4,
    "run_stage": 5,
}

#: the measured test: p stages, m microbatches, the cap on the microbatches a stage holds
FAST_P, FAST_M = 4, 8
FAST_TIERS = Tiers(
    quantity="emulated step time / ideal (F = B = W = 1 unit, ideal 3m)",
    unit="x",
    # 1F1B (the library's, and task 4's): 1 + (p-1)/m = 1.375; backwards split into B and W, each
    # W right after its B: 1.25; the Ws held back to fill the idle time: 1 + (p-1)/(3m) = 1.125,
    # the least a schedule can take (the last stage starts after p - 1 forwards)
    levels=((1.13, 1.0), (1.26, 0.5), (1.38, 0.25)),
    lower_is_better=True,
    baseline="the library's 1F1B (minidist.parallel.pipeline.one_f_one_b) takes 1.375x",
)


def _seed(seed: int, base: int) -> int:
    return (seed * 1000 + base) % 2**31


def linear_spec(seed: int, base: int, kind: str, world_size: int, **extra) -> dict:
    rng = random.Random(_seed(seed, base))
    p = world_size
    return {
        "seed": _seed(seed, base),
        "kind": kind,
        "world_size": p,
        "batch": rng.choice([2, 3]),
        "seq": rng.choice([3, 5]),
        "d_in": p * rng.choice([3, 5, 6]),
        "d_out": p * rng.choice([3, 5, 7]),
        "bias": True,
        "gather_output": False,
        "input_is_parallel": True,
        **extra,
    }


def mlp_spec(seed: int, base: int, world_size: int, calls: int = 1) -> dict:
    rng = random.Random(_seed(seed, base))
    return {
        "seed": _seed(seed, base),
        "world_size": world_size,
        "batch": rng.choice([2, 3]),
        "seq": rng.choice([5, 7]),
        "d": rng.choice([10, 12, 14]),
        "ffn": world_size * rng.choice([5, 6, 9]),
        "calls": calls,
    }


def schedule_cases(seed: int) -> list[list[int]]:
    rng = random.Random(_seed(seed, 60))
    cases = [[1, 3], [2, 1], [3, 7], [4, 4], [5, 2], [4, 9]]
    cases.append([rng.randint(6, 8), rng.randint(3, 12)])
    return cases


def pipeline_spec(seed: int, base: int, world_size: int, m: int, schedule: str) -> dict:
    rng = random.Random(_seed(seed, base))
    rows, width = rng.choice([3, 4, 5]), rng.choice([6, 7, 9])
    plans = {"1f1b": ref.one_f_one_b, "gpipe": ref.gpipe, "split": ref.split_late}
    plan = plans[schedule](world_size, m) if schedule in plans else None  # None: the student's
    return {
        "seed": _seed(seed, base),
        "world_size": world_size,
        "m": m,
        "rows": rows,
        "width": width,
        "classes": rng.choice([3, 4]),
        "activation_bytes": rows * width * 4,
        "schedule": None if plan is None else [[list(a) for a in actions] for actions in plan],
    }


# --- the cases ---------------------------------------------------------------------------------
def cases(seed: int) -> list[Case]:
    out: list[Case] = []

    def add(name, points, function, worker, args, check, world_size=1, tiers=None):
        out.append(Case(name, points, function, worker, world_size, args, check, "pipe", tiers))

    for p in (2, 3):
        s = {"seed": _seed(seed, 10 + p), "world_size": p, "shape": [3, 4]}
        add(
            f"test_conjugate_operators[{p}]",
            2,
            "copy_to_tensor_parallel",
            "operators",
            [s],
            ref.operators_check(f"f and g on {p} ranks", s),
            p,
        )
    for name, base, p, extra in (
        ("column-2", 20, 2, {}),
        ("column-4-gather", 21, 4, {"gather_output": True}),
        ("column-3-nobias", 22, 3, {"bias": False}),
    ):
        s = linear_spec(seed, base, "column", p, **extra)
        what = f"ColumnParallelLinear({s['d_in']}, {s['d_out']}) on {p} ranks {extra or ''}".strip()
        add(
            f"test_column_parallel[{name}]",
            2,
            "ColumnParallelLinear",
            "linear",
            [s],
            ref.linear_check(what, s),
            p,
        )
    for name, base, p, extra in (
        ("row-2", 30, 2, {}),
        ("row-4-scatter", 31, 4, {"input_is_parallel": False}),
        ("row-3-nobias", 32, 3, {"bias": False}),
    ):
        s = linear_spec(seed, base, "row", p, **extra)
        what = f"RowParallelLinear({s['d_in']}, {s['d_out']}) on {p} ranks {extra or ''}".strip()
        add(f"test_row_parallel[{name}]", 2, "RowParallelLinear", "linear", [s], ref.linear_check(what, s), p)
    for p, base in ((2, 40), (4, 41)):
        s = mlp_spec(seed, base, p)
        what = f"ParallelMLP({s['d']}, {s['ffn']}) on {p} ranks"
        add(f"test_parallel_mlp_equals_dense[{p}]", 3, "ParallelMLP", "mlp", [s], ref.mlp_check(what, s), p)
    for p, base in ((2, 45), (4, 46)):
        s = mlp_spec(seed, base, p, calls=2)
        what = f"ParallelMLP on {p} ranks, 2 calls"
        add(
            f"test_mlp_allreduce_count[{p}]",
            3,
            "ParallelMLP",
            "mlp",
            [s],
            ref.mlp_count_check(what, s),
            p,
        )
    sched = schedule_cases(seed)
    add(
        "test_one_f_one_b_exact",
        3,
        "one_f_one_b",
        "schedules",
        [sched],
        ref.schedule_exact_check("1F1B", sched),
    )
    add(
        "test_schedule_valid", 2, "one_f_one_b", "schedules", [sched], ref.schedule_valid_check("1F1B", sched)
    )
    add("test_schedule_bubble", 2, "one_f_one_b", "schedules", [sched], ref.bubble_check("1F1B", sched))
    add("test_schedule_peak_in_flight", 3, "one_f_one_b", "schedules", [sched], ref.peak_check("1F1B", sched))
    for name, base, p, m, kind in (
        ("2-1f1b", 70, 2, 3, "1f1b"),
        ("4-1f1b", 71, 4, 6, "1f1b"),
        ("4-gpipe", 72, 4, 3, "gpipe"),
        ("3-few", 73, 3, 2, "1f1b"),
        ("4-split", 74, 4, 5, "split"),
    ):
        s = pipeline_spec(seed, base, p, m, kind)
        what = f"run_stage on {p} stages, {m} microbatches, {kind}"
        add(f"test_run_stage[{name}]", 4, "run_stage", "pipeline", [s], ref.executor_check(what, s), p)
    s = pipeline_spec(seed, 80, FAST_P, FAST_M, "fast")
    what = f"fast_schedule({FAST_P}, {FAST_M}) run by your run_stage"
    add(
        f"test_fast_schedule[{FAST_P}-{FAST_M}]",
        8,
        "fast_schedule",
        "pipeline",
        [s],
        ref.measured_check(what, s),
        FAST_P,
        FAST_TIERS,
    )
    return out
