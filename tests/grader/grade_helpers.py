"""What the grading batches (``tests/grader/batches/test_a*.py``) share.

Each runs ``python -m grader grade <assignment>`` once on the example students of
``grader/examples/<assignment>/make.py`` and reads the gradebook back:
``grade_examples`` makes that batch, ``check_expected_scores`` holds every example to its expected
status and score (``make.LOST``, ``make.expected_score``). What each
student's feedback must say stays in the assignment's file. ``grade_solution_and_stub`` grades
the solution and the released stub on every hidden test, once per assignment:
``check_full_marks_and_zero`` holds them to all the points and none.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import psutil

from grader import grade

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


#: the user ids of the sandboxes (one per parallel job); a process of theirs alive after a run leaked
SANDBOX_UIDS = range(grade.UID_BASE, grade.UID_BASE + 16)


def sandbox_processes() -> list[int]:
    """Pids of live processes that run as a sandbox user."""
    return [
        p.pid
        for p in psutil.process_iter(["uids", "status"])
        if p.info["uids"] and p.info["uids"].real in SANDBOX_UIDS and p.info["status"] != psutil.STATUS_ZOMBIE
    ]


def gradebook(out: Path) -> dict[str, dict]:
    """``out/gradebook.csv`` as ``{submission id: row}``."""
    with open(out / "gradebook.csv", newline="") as file:
        return {row["id"]: row for row in csv.DictReader(file)}


def grade_examples(
    assignment: str, make, subset: tuple[str, ...], tmp_path: Path, *extra: str, timeout: float = 600
) -> tuple[Path, dict[str, dict]]:
    """Every example student of ``make``, graded on ``subset`` in one batch; the output folder and
    the gradebook. (The stub is graded on every test in ``grade_solution_and_stub``.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, make.build_dict())
    selection = [arg for pattern in subset for arg in ("--tests", pattern)]
    run_grader(assignment, submissions, out, "--jobs", "2", *extra, *selection, timeout=timeout)
    return out, gradebook(out)


def check_expected_scores(book: dict[str, dict], make, subset_names: list[str]) -> None:
    """alice (the solution) full marks, each example its (status, score)."""
    alice = book["alice"]
    assert alice["score"] == alice["max_score"] == f"{make.expected_score('alice', subset_names):g}", alice
    for student, (status, _) in make.LOST.items():
        score = make.expected_score(student, subset_names)
        assert (book[student]["status"], float(book[student]["score"])) == (status, score), book[student]


def grade_solution_and_stub(
    assignment: str, tmp_path: Path, timeout: float = 900
) -> tuple[Path, dict[str, dict]]:
    """The solution and the released stub, graded on every hidden test in one batch."""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    for name, folder in (("solution", "solutions"), ("stub", "assignments")):
        (submissions / name).mkdir(parents=True)
        for student_file in grade.load_assignment(assignment).student_files:
            source = ROOT / folder / assignment / student_file
            (submissions / name / student_file).write_bytes(source.read_bytes())
    run_grader(assignment, submissions, out, "--jobs", "2", timeout=timeout)
    return out, gradebook(out)


def check_full_marks_and_zero(assignment: str, out: Path, book: dict[str, dict]) -> None:
    """The solution earns every point of the table; the stub none, every test failing with its TODO."""
    cases = grade.load_assignment(assignment).cases(0)
    total = sum(case.points for case in cases)
    solution = book["solution"]
    assert solution["score"] == f"{total:g}" == solution["max_score"] and solution["status"] == "ok", solution
    assert book["stub"]["score"] == "0" and book["stub"]["status"] == "ok", book["stub"]
    stub = json.loads((out / "stub" / "results.json").read_text())
    assert len(stub["tests"]) == len(cases)
    wrong = [
        t for t in stub["tests"] if "NotImplementedError" not in t["output"] or "TODO(task" not in t["output"]
    ]
    assert not wrong, [t["output"][:200] for t in wrong]
