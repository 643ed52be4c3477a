"""What the per-assignment grading tests (``tests/test_grade*.py``) share.

Each of them runs ``python -m grader grade <assignment>`` on example submissions and reads the
gradebook back. The assignment-specific parts (which tests, which scores) stay in the test files.
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
