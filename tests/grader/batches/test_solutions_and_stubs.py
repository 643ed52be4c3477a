"""Every assignment's solution earns every point of its case table through the grader, and the
released stub none: one batch per assignment, on every hidden test, ``--jobs 2``.

The solution and the stub are graded as students' submissions are (intake, sandbox, guard, the
trusted checks): every hidden test passes on the solution with its points, and fails on the
stub with NotImplementedError naming its TODO(task N). a2's batch (``test_a2.py``) grades its
solution and stub on every test beside its examples, so it is not graded again here.

Every assignment has measured tests graded in tiers (``grader/tiers.py``, issue 26): the solution
reaches the top tier of each (it earns every point) and heads each measured test's leaderboard.
That a measured value does not depend on the machine's load is checked in each batch
(``test_aN.py``): an example's measured value is held to the one stored where it was written,
measured under another load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import (
    check_full_marks_and_zero,
    grade_solution_and_stub,
    sandbox_processes,
)
from grader import grade

ROOT = Path(__file__).resolve().parents[3]
ASSIGNMENTS = [
    "a1_collectives",
    "a3_ddp",
    "a4_compression",
    "a5_model_parallel",
    "a6_inference",
    "a7_zero",
    "a8_experts",
    "a9_resilient",
]
EVERY_ASSIGNMENT = sorted([*ASSIGNMENTS, "a2_async"])


def check_measured(name: str, out: Path) -> None:
    """Every measured test of the solution has a value, and one leaderboard each, the solution on it."""
    measured = [case.name for case in grade.load_assignment(name).measured()]
    values = json.loads((out / "solution" / "results.json").read_text())["extra_data"]["measured"]
    assert sorted(values) == sorted(measured) and all(v is not None for v in values.values()), values
    boards = sorted((out / "leaderboard").iterdir())
    assert len(boards) == len(measured) and all("\n1,solution," in p.read_text() for p in boards)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_solution_scores_full_marks_and_the_stub_zero_on_every_test(name, tmp_path):
    out, book = grade_solution_and_stub(name, tmp_path)
    check_full_marks_and_zero(name, out, book)
    check_measured(name, out)
    assert not sandbox_processes(), "a process of the sandbox outlived its grading"


@pytest.mark.parametrize("name", EVERY_ASSIGNMENT)
def test_every_assignment_has_a_measured_task_that_names_its_baseline(name):
    measured = grade.load_assignment(name).measured()
    assert measured, f"{name} has no test graded in tiers"
    for case in measured:
        assert case.tiers.baseline, f"{case.name}: say what the library's version measures"
