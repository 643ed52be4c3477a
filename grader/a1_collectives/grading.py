"""How ``python -m grader grade`` runs assignment 1: the hidden tests as jobs plus trusted checks.

``test_hidden.py`` is what an instructor runs with pytest. The grader runs the *same* tests
differently, so that nothing the student's code does can pass one:

* each test becomes a ``Job`` -- which worker of ``workers.py`` to launch, on how many ranks,
  with which arguments (the cases, with seeds the grader chose for this student) -- that the
  sandbox runs, writing the raw reports back as JSON and ``.npy`` files;
* the ``check`` of each test runs here, in the grader's own process, on those reports: the
  expected values come from ``test_hidden``'s single-process references, recomputed from the
  seeds. The sandbox never sees ``test_hidden.py``, the expected values or the points.

The names and points are those of ``test_hidden.py`` (``tests/test_grade.py`` checks that the
two lists agree), so the gradebook reads like the pytest report an instructor knows.
"""

from __future__ import annotations

import re

from grader.forbidden import Rules
from grader.plan import (
    GradedTest,
    Job,
    import_failure_of,
    ranked_failure_message,
)

from . import STUDENT_FILES, rules
from . import test_hidden as hidden

__all__ = [
    "STUDENT_FILES",
    "SANDBOX_FILES",
    "FORBIDDEN",
    "SIMILAR_TO",
    "GIVEN_FUNCTIONS",
    "graded_tests",
    "failure_message",
    "import_failure",
    "redact",
    "HINTS",
]

#: files of this folder the sandbox needs (workers, and the rules their guard enforces); never test_hidden.py
SANDBOX_FILES = ("workers.py", "rules.py")
#: what a submission may not use (``rules.py``): refused at intake and, in the sandbox, at run time
FORBIDDEN = Rules.of(rules)
#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = ("lib/minidist/collectives/*.py",)
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = ("chunk_offsets", "exchange")
WORKERS_MODULE = "workers"

HINTS = {
    "tree_broadcast": "Number ranks relative to the source (vrank); in round k ranks below 2**k send.",
    "ring_allgather": "Copy your own tensor into out[rank]; step s sends block (rank - s) % p right.",
    "ring_reduce_scatter": "Check dim 0 first; receive into a scratch row and add it to the block.",
    "ring_allreduce": "Work on a flat contiguous copy; reduce-scatter then allgather over chunk_offsets.",
    "butterfly_allreduce": "Fold the first 2 * (p - p2) ranks in and out; pair vrank with vrank ^ distance.",
}


def _seeded(cases: list[dict], seed: int) -> list[dict]:
    """The cases with seeds only this run knows (``seed`` is derived from a key the student never sees)."""
    return [{**case, "seed": seed * 1000 + case.get("seed", 0)} for case in cases]


def _values_test(name, points, function, world_size, cases, seed, transport="shm", extra=None) -> GradedTest:
    cases = _seeded(cases, seed)

    def check(outs: list) -> None:
        hidden.check_values(function, world_size, cases, outs, transport)
        if extra is not None:
            extra(world_size, cases, outs)

    job = Job(WORKERS_MODULE, "run_cases", world_size, [function, cases], transport)
    return GradedTest(name, points, function, job, check)


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    tests: list[GradedTest] = []
    add = tests.append
    for p in hidden.ALL_WORLD_SIZES:
        add(
            _values_test(
                f"test_tree_broadcast[{p}]",
                1,
                "tree_broadcast",
                p,
                hidden.value_cases("tree_broadcast", p),
                seed,
            )
        )
    for p in (5, 8):
        cases = hidden.budget_cases("tree_broadcast", p)
        name = f"test_tree_broadcast_sends_along_a_binomial_tree[{p}]"
        add(_values_test(name, 2, "tree_broadcast", p, cases, seed, extra=hidden.check_tree_broadcast_budget))
    for p in hidden.ALL_WORLD_SIZES:
        add(
            _values_test(
                f"test_ring_allgather[{p}]",
                1,
                "ring_allgather",
                p,
                hidden.value_cases("ring_allgather", p),
                seed,
            )
        )
    for p in (3, 6):
        cases = hidden.budget_cases("ring_allgather", p)
        add(
            _values_test(
                f"test_ring_allgather_budget[{p}]",
                2,
                "ring_allgather",
                p,
                cases,
                seed,
                extra=hidden.check_ring_allgather_budget,
            )
        )
    add(
        _values_test(
            "test_ring_allgather_large", 1, "ring_allgather", 4, [{"shape": (262_144,), "seed": 1}], seed
        )
    )
    for p in hidden.ALL_WORLD_SIZES:
        cases = hidden.value_cases("ring_reduce_scatter", p)
        add(_values_test(f"test_ring_reduce_scatter[{p}]", 1, "ring_reduce_scatter", p, cases, seed))
    for index, (p, shape) in enumerate([(3, (4, 2)), (4, (2,)), (4, (6, 0))]):
        add(
            _rejects_test(
                f"test_ring_reduce_scatter_rejects_indivisible_first_dimension[{p}-shape{index}]", p, shape
            )
        )
    for p in (3, 6):
        cases = hidden.budget_cases("ring_reduce_scatter", p)
        name = f"test_ring_reduce_scatter_budget[{p}]"
        add(
            _values_test(
                name, 2, "ring_reduce_scatter", p, cases, seed, extra=hidden.check_ring_reduce_scatter_budget
            )
        )
    add(
        _values_test(
            "test_ring_reduce_scatter_large",
            1,
            "ring_reduce_scatter",
            4,
            [{"shape": (1_048_576,), "seed": 2}],
            seed,
        )
    )
    for p in hidden.ALL_WORLD_SIZES:
        for function in ("ring_allreduce", "butterfly_allreduce"):
            add(
                _values_test(
                    f"test_allreduce[{p}-{function}]", 1, function, p, hidden.value_cases(function, p), seed
                )
            )
    for function, p in (("ring_allreduce", 4), ("butterfly_allreduce", 6)):
        add(
            _values_test(
                f"test_allreduce_large[{function}-{p}]",
                2,
                function,
                p,
                [{"shape": (1_000_003,), "seed": 3}],
                seed,
            )
        )
    for p in (3, 4, 5, 8):
        cases = hidden.budget_cases("ring_allreduce", p)
        add(
            _values_test(
                f"test_ring_allreduce_budget[{p}]",
                2,
                "ring_allreduce",
                p,
                cases,
                seed,
                extra=hidden.check_ring_allreduce_budget,
            )
        )
    for p in (4, 6, 7, 8):
        cases = hidden.budget_cases("butterfly_allreduce", p)
        name = f"test_butterfly_allreduce_budget[{p}]"
        add(
            _values_test(
                name, 2, "butterfly_allreduce", p, cases, seed, extra=hidden.check_butterfly_allreduce_budget
            )
        )
    for function in hidden.TASKS:
        for transport in ("pipe", "torch"):
            add(
                _values_test(
                    f"test_other_transports[{function}-{transport}]",
                    1,
                    function,
                    3,
                    _transport_cases(function),
                    seed,
                    transport,
                )
            )
    return tests


def _transport_cases(function: str) -> list[dict]:
    """The cases of ``test_other_transports`` (p = 3)."""
    p = 3
    shapes = [(0,), (2 * p, 5), (p,)] if function == "ring_reduce_scatter" else [(0,), (2,), (7, 5)]
    cases = [{"shape": shape, "seed": seed, "src": p - 1} for seed, shape in enumerate(shapes)]
    cases.append({"shape": (2 * p, 3), "dtype": "float64", "layout": "transposed", "seed": 9, "src": 1})
    if function != "tree_broadcast":
        cases = [{key: value for key, value in case.items() if key != "src"} for case in cases]
    return cases


def _rejects_test(name: str, p: int, shape: tuple[int, ...]) -> GradedTest:
    def check(outs: list) -> None:
        hidden.check_rejects(p, shape, outs)

    job = Job(WORKERS_MODULE, "reduce_scatter_rejects", p, [list(shape)], "shm")
    return GradedTest(name, 1, "ring_reduce_scatter", job, check)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    return ranked_failure_message(hidden, test, error, seconds)


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because ``collectives.py`` could not be imported."""
    return import_failure_of(error, 'import_module("collectives")')


_EXPECTED_VALUE = re.compile(r"(element \([^)]*\) is [^,]+), expected [^(]+\(")


def redact(message: str) -> str:
    """What a student may see: the wrong element and its value, not the expected value."""
    return _EXPECTED_VALUE.sub(r"\1, which is wrong (", message)
