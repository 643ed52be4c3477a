"""Every assignment's solution earns every point of its case table through the grader, and the
released stub none: one batch per assignment, on every hidden test, ``--jobs 2``.

The solution and the stub are graded as students' submissions are (intake, sandbox, guard, the
trusted checks): every hidden test passes on the solution with its points, and fails on the
stub with NotImplementedError naming its TODO(task N). a2's batch (``test_a2.py``) grades its
solution and stub on every test beside its examples, so it is not graded again here.

Every assignment has measured tests graded in tiers (``grader/tiers.py``, issue 26): the solution
reaches the top tier of each (it earns every point), and a second grading of its measured tests
(``--force``, the same seed key, the other batches loading the machine) measures the same values
and gives the same points: nothing measured depends on the machine's load.
"""

from __future__ import annotations

import glob
import json
import shutil
from pathlib import Path

import pytest

from grade_helpers import (
    check_full_marks_and_zero,
    grade_solution_and_stub,
    gradebook,
    run_grader,
    sandbox_processes,
)
from grader import grade

ROOT = Path(__file__).resolve().parents[3]
ASSIGNMENTS = ["a1_collectives", "a3_ddp", "a4_compression", "a5_model_parallel", "a6_inference", "a7_zero"]
EVERY_ASSIGNMENT = sorted([*ASSIGNMENTS, "a2_async"])


def measured_results(out: Path, student: str) -> tuple[dict, dict]:
    """A student's measured values and the points of its measured tests, from its results.json."""
    data = json.loads((out / student / "results.json").read_text())
    values = data["extra_data"]["measured"]
    return values, {t["name"]: t["score"] for t in data["tests"] if t["name"] in values}


def regrade_measured(name: str, out: Path) -> None:
    """The solution's measured tests graded again into ``out``: the same values and points."""
    measured = [case.name for case in grade.load_assignment(name).measured()]
    first = measured_results(out, "solution")
    assert sorted(first[0]) == sorted(measured) and all(v is not None for v in first[0].values()), first
    shutil.rmtree(out / "stub", ignore_errors=True)
    submissions = out.parent / "again"
    shutil.rmtree(submissions, ignore_errors=True)
    (submissions / "solution").mkdir(parents=True)
    for student_file in grade.load_assignment(name).student_files:
        shutil.copy(ROOT / "solutions" / name / student_file, submissions / "solution" / student_file)
    selection = [arg for test in measured for arg in ("--tests", glob.escape(test))]
    run_grader(name, submissions, out, "--jobs", "2", "--force", *selection, timeout=600)
    assert measured_results(out, "solution") == first
    boards = sorted((out / "leaderboard").iterdir())  # one per measured test, the solution on each
    assert len(boards) == len(measured) and all("\n1,solution," in p.read_text() for p in boards)
    assert gradebook(out)["solution"]["status"] == "ok"


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_solution_scores_full_marks_and_the_stub_zero_on_every_test(name, tmp_path):
    out, book = grade_solution_and_stub(name, tmp_path)
    check_full_marks_and_zero(name, out, book)
    regrade_measured(name, out)
    assert not sandbox_processes(), "a process of the sandbox outlived its grading"


@pytest.mark.parametrize("name", EVERY_ASSIGNMENT)
def test_every_assignment_has_a_measured_task_that_names_its_baseline(name):
    measured = grade.load_assignment(name).measured()
    assert measured, f"{name} has no test graded in tiers"
    for case in measured:
        assert case.tiers.baseline, f"{case.name}: say what the library's version measures"
