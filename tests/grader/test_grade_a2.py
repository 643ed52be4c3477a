"""``python -m grader grade a2_async``: assignment 2 goes through the same pipeline as a1.

The graded tests are the hidden tests with their points; the solution scores full marks, the
released stub zero (every test failing with NotImplementedError), and the example students of
``grader/examples/a2_async/make.py`` get exactly their expected scores, a deadlock included.

Fast: the grading batch of the examples is ``tests/grader/batches/test_a2.py``.
"""

from __future__ import annotations

from pathlib import Path

from grader.a2_async.grading import ASSIGNMENT as assignment

ROOT = Path(__file__).resolve().parents[2]


def test_the_case_table_holds_the_tests_this_file_grades():
    graded = assignment.graded_tests(seed=12345)
    names = [t.name for t in graded]
    assert len(names) >= 15


def test_feedback_never_shows_expected_values():
    message = "x: the table: element (3, 1) is 0.125, expected 0.25 (4 of 10 elements are wrong)"
    assert "0.25" not in assignment.redact(message) and "0.125" in assignment.redact(message)
    assert "0.05" not in assignment.redact("the loss of epoch 2 is 0.0712, expected 0.05")
