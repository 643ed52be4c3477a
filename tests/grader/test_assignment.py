"""``grader/assignment.py``: one declaration per assignment gives the graded jobs and the pytest tests.

Checked for every assignment (``ASSIGNMENTS``): the declaration is complete (its files exist,
every case's function has a task and a hint, points are positive, names unique), the pytest
tests generated from the table are exactly its cases with their points (what pytest collects
and what the grader grades cannot drift apart: both come from ``cases(seed)``), and a seed
changes the data, never the tests. The failure texts are checked on one declaration.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
from pathlib import Path

import pytest

from grader import grade
from grader.assignment import Assignment, Case, import_failure_of, redact_expected

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENTS = [
    "a1_collectives",
    "a2_async",
    "a3_ddp",
    "a4_compression",
    "a5_model_parallel",
    "a6_inference",
    "a7_zero",
    "a8_experts",
    "a9_resilient",
]


def declared(name: str) -> Assignment:
    return grade.load_assignment(name)


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_declaration_is_complete(name):
    assignment = declared(name)
    assert assignment.name == name
    for student_file in assignment.student_files:
        assert (ROOT / "solutions" / name / student_file).is_file(), student_file
        assert (ROOT / "assignments" / name / student_file).is_file(), student_file
    for sandbox_file in assignment.sandbox_files:
        assert (ROOT / "grader" / name / sandbox_file).is_file(), sandbox_file
    assert "cases.py" not in assignment.sandbox_files and "reference.py" not in assignment.sandbox_files
    assert all(list(ROOT.glob(pattern)) for pattern in assignment.similar_to), assignment.similar_to
    cases = assignment.cases(0)
    names = [case.name for case in cases]
    assert names and len(names) == len(set(names)), "case names must be unique"
    for case in cases:
        assert case.points > 0, case.name
        assert case.function in assignment.tasks and case.function in assignment.hints, case.name
        assert case.world_size >= 1 and case.transport in ("shm", "pipe", "torch"), case.name
    assert set(assignment.tasks) == set(assignment.hints), "a hint for every task, a task for every hint"


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_pytest_tests_are_the_cases_with_their_points(name):
    assignment = declared(name)
    expected = {case.name: case.points for case in assignment.cases(0)}
    collected = {}
    for function_name, function in assignment.pytest_tests().items():
        assert function.__name__ == function_name
        marks = getattr(function, "pytestmark", [])
        parametrize = [m for m in marks if m.name == "parametrize"]
        if not parametrize:
            (points,) = [m.args[0] for m in marks if m.name == "points"]
            collected[function_name] = points
            continue
        for param in parametrize[0].args[1]:
            (points,) = [m.args[0] for m in param.marks if m.name == "points"]
            collected[f"{function_name}[{param.id}]"] = points
    assert collected == expected
    # the module pytest collects holds exactly these functions
    hidden = importlib.import_module(f"grader.{name}.test_hidden")
    assert sorted(n for n in vars(hidden) if n.startswith("test_")) == sorted(assignment.pytest_tests())


#: tests whose inputs are fixed by what they test (a shape no world size divides; a table of rates;
#: a measured task the same for everyone, so that its leaderboard compares like with like)
SEED_FREE = {
    "a1_collectives": ("test_ring_reduce_scatter_rejects_indivisible_first_dimension[[]*",),
    "a2_async": ("test_staleness_aware_lr", "test_prefetching_worker_time"),
    "a4_compression": ("test_bytes_to_target_loss[[]*",),
    # the course's decoder and its held-out text are the same for every student
    "a6_inference": ("test_quantized_decoder_bits",),
    "a7_zero": ("test_peak_memory[[]*",),
    "a8_experts": ("test_bytes_per_token[[]*",),
    "a9_resilient": ("test_time_to_target[[]*",),
}


@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_seeds_change_the_data_not_the_tests(name):
    assignment = declared(name)
    one, two = assignment.graded_tests(1), assignment.graded_tests(2)
    assert [(t.name, t.points, t.function) for t in one] == [(t.name, t.points, t.function) for t in two]
    unchanged = [t.name for t, u in zip(one, two, strict=True) if t.job.args == u.job.args]
    free = SEED_FREE.get(name, ())
    assert all(any(fnmatch.fnmatchcase(n, p) for p in free) for n in unchanged), unchanged
    json.dumps([t.job.as_json("t", 1.0) for t in one])  # jobs travel as JSON


def _toy(**overrides) -> Assignment:
    def cases(seed: int) -> list[Case]:
        check = lambda outs: None  # noqa: E731
        return [
            Case("test_alone", 2, "f", "work", 1, [seed], check),
            Case("test_sizes[2-shm]", 1, "g", "work", 2, [seed], check),
            Case("test_sizes[3-pipe]", 3, "g", "work", 3, [seed], check, "pipe"),
        ]

    fields = dict(
        name="toy",
        student_files=("toy.py",),
        rules=json,  # any module: only ``forbidden`` reads it
        tasks={"f": 1, "g": 2},
        hints={"f": "do f", "g": "do g"},
        cases=cases,
        similar_to=(),
        student_code="toy.py",
        deadlock_hint="Every send needs its recv.",
    )
    return Assignment(**{**fields, **overrides})


def test_cases_become_jobs_and_pytest_functions():
    toy = _toy()
    tests = toy.graded_tests(7)
    assert [(t.name, t.points, t.function) for t in tests] == [
        ("test_alone", 2, "f"),
        ("test_sizes[2-shm]", 1, "g"),
        ("test_sizes[3-pipe]", 3, "g"),
    ]
    assert tests[2].job.as_json("x", 9.0) == {
        "id": "x",
        "module": "workers",
        "worker": "work",
        "world_size": 3,
        "args": [7],
        "transport": "pipe",
        "timeout": 9.0,
    }
    functions = toy.pytest_tests()
    assert list(functions) == ["test_alone", "test_sizes"]
    assert [p.id for p in functions["test_sizes"].pytestmark[0].args[1]] == ["2-shm", "3-pipe"]


def test_a_name_given_twice_or_half_parametrised_is_refused():
    twice = _toy(cases=lambda seed: [Case("test_a", 1, "f", "w", 1, [], print)] * 2)
    with pytest.raises(ValueError, match="2 cases are named test_a"):
        twice.pytest_tests()
    half = _toy(
        cases=lambda seed: [
            Case("test_a", 1, "f", "w", 1, [], print),
            Case("test_a[x]", 1, "f", "w", 1, [], print),
        ]
    )
    with pytest.raises(ValueError, match="must all have parameters or none"):
        half.pytest_tests()


def test_a_one_process_assignment_checks_the_first_report():
    seen = []
    toy = _toy(one_process=True, cases=lambda seed: [Case("test_a", 1, "f", "w", 1, [], seen.append)])
    toy.graded_tests(0)[0].check([{"report": 1}])
    assert seen == [{"report": 1}]


def test_failure_texts_name_the_task_the_file_and_the_ranks():
    toy, test = _toy(), _toy().graded_tests(0)[1]
    stub = {
        "kind": "worker",
        "exc_type": "NotImplementedError",
        "summary": "TODO(task 2)",
        "rank": 1,
        "text": "tb",
    }
    assert toy.failure_message(test, stub, 10) == (
        "rank 1 raised NotImplementedError: TODO(task 2) (fill in TODO(task 2) in toy.py)"
    )
    crash = {"kind": "worker", "exc_type": "ValueError", "summary": "bad", "rank": 0, "text": "tb"}
    assert toy.failure_message(test, crash, 10) == "g failed on 2 rank(s) (transport 'shm'): tb"
    late = toy.failure_message(test, {"kind": "timeout", "text": "stuck in recv"}, 4)
    where = "on 2 rank(s) (transport 'shm')"
    assert late == f"g: did not finish within 4 s {where}; Every send needs its recv. stuck in recv"
    one = _toy(one_process=True)
    assert one.failure_message(test, crash, 10) == "g failed: tb"
    assert (
        toy.failure_message(test, {"kind": "harness", "text": "no record"}, 1)
        == "g: the test harness failed: no record"
    )


def test_import_failures_and_redaction():
    assert import_failure_of({"kind": "worker", "exc_type": "SyntaxError", "summary": "line 3"}, "x") == (
        "SyntaxError: line 3"
    )
    assert import_failure_of(
        {"kind": "worker", "exc_type": "", "text": 'import_module("toy")'}, "import_module("
    )
    assert (
        import_failure_of({"kind": "worker", "exc_type": "ValueError", "text": "tb"}, "import_module(")
        is None
    )
    assert import_failure_of({"kind": "timeout"}, "x") is None
    message = "w: element (3, 1) is 0.125, expected 0.25 (4 of 10 elements differ)"
    assert redact_expected(message) == "w: element (3, 1) is 0.125, which is wrong (4 of 10 elements differ)"
