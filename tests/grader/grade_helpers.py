"""What the per-assignment grading tests (``tests/test_grade*.py``) share.

Each of them runs ``python -m grader grade <assignment>`` on example submissions and reads the
gradebook back, and checks that ``grading.graded_tests`` lists exactly the hidden tests pytest
collects, with their points. The assignment-specific parts (which tests, which scores) stay in
the test files.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_grader(assignment: str, submissions: Path, out: Path, *extra: str, timeout: float) -> str:
    """``python -m grader grade <assignment> <submissions> --out <out> <extra>``; its output.

    Fails the test (with the end of the output) when the grader itself fails; in its own session,
    so that a timeout kills what the grader started as well.
    """
    command = [sys.executable, "-m", "grader", "grade", assignment, str(submissions), "--out", str(out)]
    result = subprocess.run(
        [*command, *extra], cwd=ROOT, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def gradebook(out: Path) -> dict[str, dict]:
    """``out/gradebook.csv`` as ``{submission id: row}``."""
    with open(out / "gradebook.csv", newline="") as file:
        return {row["id"]: row for row in csv.DictReader(file)}


def hidden_test_names(assignment: str) -> list[str]:
    """The names pytest collects in ``grader/<assignment>`` (``test_x[params]``), in its order."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        f"grader/{assignment}",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    collected = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout
    return [line.split("::", 1)[1] for line in collected.splitlines() if "::" in line]


def check_points_and_hints(graded: list, grading, hidden) -> None:
    """Each graded test has the points of its hidden test's ``points`` marker, a hint and a task."""
    for test in graded:
        function = getattr(hidden, test.name.split("[")[0])
        marker = next(m for m in function.pytestmark if m.name == "points")
        assert test.points == marker.args[0], test.name
        assert test.function in grading.HINTS and test.function in hidden.TASKS
