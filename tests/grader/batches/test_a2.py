"""``python -m grader grade a2_async``: the solution, the stub and the example students, graded once.

One batch on every hidden test: the solution full marks, the released stub zero (every test
failing with NotImplementedError), the examples of ``grader/examples/a2_async/make.py`` their
expected scores; then a deadlocking student on three tests with a 3 s timeout (a deadlock costs
only the tests it hangs), with library_worker (the library's worker as ``prefetching_worker``:
the measured test's third tier). The reference and the feedback texts: ``tests/grader/test_grade_a2.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader
from grader import similarity
from grader.a2_async.grading import ASSIGNMENT as assignment
from grader.examples.a2_async import make

ROOT = Path(__file__).resolve().parents[3]
MEASURED = "test_prefetching_worker_time"


def grade(submissions: Path, out: Path, *extra: str) -> str:
    return run_grader("a2_async", submissions, out, *extra, timeout=300)


@pytest.mark.timeout(300)
def test_the_solution_scores_full_marks_the_stub_zero_and_the_examples_their_scores(tmp_path):
    submissions = tmp_path / "subs"
    examples = make.build_dict()
    students = ("alice", "carol", "erin", "library_trainer", "hidden_trainer")
    make.write(submissions, {name: examples[name] for name in students})
    (submissions / "stub").mkdir()
    (submissions / "stub" / make.FILE).write_bytes(make.STUB.read_bytes())
    out = tmp_path / "out"
    grade(submissions, out, "--jobs", "2", "--test-timeout", "20")
    book = gradebook(out)
    total = sum(t.points for t in assignment.graded_tests(0))
    assert book["alice"]["score"] == f"{total:g}" == book["alice"]["max_score"], book["alice"]
    assert book["stub"]["score"] == "0" and book["stub"]["status"] == "ok"
    stub = json.loads((out / "stub" / "results.json").read_text())
    assert len(stub["tests"]) == len(assignment.graded_tests(0))
    assert all("NotImplementedError" in t["output"] and "TODO(task" in t["output"] for t in stub["tests"])
    for student in students[1:]:
        status, score = make.EXPECTED[student]
        assert (book[student]["status"], float(book[student]["score"])) == (status, score), book[student]
    feedback = (out / "carol" / "feedback.md").read_text()
    assert "which is wrong" in feedback and "def test_" not in feedback
    # the library's trainer: refused at intake (import named), or at run time (reached through
    # the benchmark's import of it)
    assert "minidist.glove.trainers.hogwild" in book["library_trainer"]["reason"]
    assert "refused at run time" in book["hidden_trainer"]["reason"]
    assert "hogwild" in book["hidden_trainer"]["reason"]
    assert "What you may use instead" in (out / "hidden_trainer" / "feedback.md").read_text()
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT

    # a deadlock costs one test timeout per test it hangs, and only those tests' points; with dave,
    # library_worker, the library's worker as prefetching_worker: the measured test's third tier
    dave = tmp_path / "dave"
    make.write(dave, {name: examples[name] for name in ("dave", "library_worker")})
    grade(
        dave,
        tmp_path / "out-dave",
        "--test-timeout",
        "3",
        "--tests",
        "test_server_lockstep*",
        "--tests",
        "test_worker_alone*",
        "--tests",
        MEASURED,
    )
    book = gradebook(tmp_path / "out-dave")
    row = book["library_worker"]
    assert (float(row["score"]), row["max_score"]) == (9 + 1.5, "15"), row
    measured = json.loads((tmp_path / "out-dave" / "library_worker" / "results.json").read_text())
    assert round(measured["extra_data"]["measured"][MEASURED], 2) == 1.86, measured["extra_data"]
    board = (tmp_path / "out-dave" / "leaderboard" / f"{MEASURED}.csv").read_text()
    assert "\n1,dave," in board and "\n2,library_worker," in board, board
    row = book["dave"]
    assert (row["score"], row["max_score"]) == ("12", "15"), row
    # a server waiting for a worker that returned without DONE hangs until the test timeout, or, when
    # the transport tells it that the worker has closed its communicator, fails at once
    feedback = (tmp_path / "out-dave" / "dave" / "feedback.md").read_text()
    assert "did not finish within 3 s" in feedback or "has closed its communicator" in feedback, feedback
