"""Every assignment's solution earns every point of its case table through the grader, and the
released stub none: one batch per assignment, on every hidden test, ``--jobs 2``.

The solution and the stub are graded as students' submissions are (intake, sandbox, guard, the
trusted checks): every hidden test passes on the solution with its points, and fails on the
stub with NotImplementedError naming its TODO(task N). a2's batch (``test_a2.py``) grades its
solution and stub on every test beside its examples, so it is not graded again here.
"""

from __future__ import annotations

import pytest

from grade_helpers import check_full_marks_and_zero, grade_solution_and_stub, sandbox_processes

ASSIGNMENTS = ["a1_collectives", "a3_ddp", "a4_compression", "a5_model_parallel", "a6_inference"]


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("name", ASSIGNMENTS)
def test_the_solution_scores_full_marks_and_the_stub_zero_on_every_test(name, tmp_path):
    out, book = grade_solution_and_stub(name, tmp_path)
    check_full_marks_and_zero(name, out, book)
    assert not sandbox_processes(), "a process of the sandbox outlived its grading"
