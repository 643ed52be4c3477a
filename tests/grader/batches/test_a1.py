"""``python -m grader grade a1_collectives``: the example students and the solution, graded once each.

Two batches, each graded once in a module-scoped fixture and read by many tests:

* ``batch``: every example student of ``grader/examples/a1_collectives/make.py`` (realistic, broken,
  hostile, cheating) on a SUBSET of the hidden tests (5 tests, 6 points) with a 4 s test timeout,
  so that a deadlock or an infinite loop costs seconds. The same output folder is then graded
  again: a rerun reuses every finished submission, a submission whose results are gone is graded
  again to the same gradebook (same seed key, same grades), a changed one is graded anew.
``test_a_copy_of_the_library_does_not_reach_the_top_tier`` grades library_auto (the library's
``md.allreduce(algorithm="auto")`` as ``fast_allreduce``) on the two measured tests alone.
The solution and the released stub on every hidden test: ``test_solutions_and_stubs.py``.

The hostile students that attack the sandbox itself are graded in ``test_hostile.py``.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader, sandbox_processes
from grader import similarity
from grader.a1_collectives.grading import ASSIGNMENT as assignment
from grader.examples.a1_collectives import make
from grader.examples.common import write

ROOT = Path(__file__).resolve().parents[3]
SUBSET = [
    "test_tree_broadcast[[]3]",
    "test_ring_allgather[[]3]",
    "test_allreduce[[]3-*]",
    "test_ring_allreduce_budget[[]3]",
]
EXAMPLE_OPTIONS = ("--jobs", "2", "--test-timeout", "4", "--timeout", "120", "--seed-key", "k")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the fork bomb and memory hog are only safe under the root sandbox"
)


def grade(submissions: Path, out: Path, *extra: str, tests=SUBSET, timeout: float = 600) -> str:
    selection = [arg for pattern in tests or [] for arg in ("--tests", pattern)]
    return run_grader("a1_collectives", submissions, out, *selection, *extra, timeout=timeout)


# on SUBSET: tree_broadcast[3], ring_allgather[3], allreduce[3-*] (1 point each), ring budget[3] (2)
REALISTIC = {
    "alice": ("ok", 6),
    "bob": ("ok", 3),  # no butterfly, and a "ring" allreduce over the byte budget
    "carol": ("ok", 0),
    "dave": ("ok", 3),  # the ring allreduce deadlocks
    "erin": ("import_error", 0),
    "frank": ("ok", 6),
    "library_auto": ("ok", 6),  # its fast_allreduce is not on SUBSET: see the measured test below
}
EXPECTED = {**REALISTIC, **make.BAD, **make.CHEATING}


@dataclass
class Batch:
    submissions: Path
    out: Path
    output: str  # what the grader printed
    book: dict[str, dict]
    leftovers: list  # sandbox processes alive right after the run


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> Batch:
    submissions = tmp_path_factory.mktemp("submissions")
    make.build(submissions, bad=True)
    out = tmp_path_factory.mktemp("graded") / "out"
    output = grade(submissions, out, *EXAMPLE_OPTIONS)
    return Batch(submissions, out, output, gradebook(out), sandbox_processes())


def test_the_subset_is_in_the_case_table():
    names = [t.name for t in assignment.graded_tests(0)]
    assert all(fnmatch.filter(names, pattern) for pattern in SUBSET), SUBSET


@pytest.mark.timeout(700)
def test_every_example_gets_its_status_and_score(batch):
    book = batch.book
    assert set(book) == set(EXPECTED)
    for student, (status, score) in EXPECTED.items():
        row = book[student]
        assert float(row["score"]) == score, (student, row)
        assert row["max_score"] == "6", (student, row)
        if status is not None:
            assert row["status"] == status, (student, row)
        if status in ("invalid_submission", "forbidden"):
            assert row["reason"], student
    assert "alice" in batch.output and "invalid_submission" in batch.output  # the summary table
    assert not batch.leftovers, "a submission's process outlived its grading"


@pytest.mark.timeout(700)
def test_what_each_student_sees(batch):
    # Gradescope's schema, no expected values, no hidden source
    out = batch.out
    results = json.loads((out / "carol" / "results.json").read_text())
    assert set(results) >= {"score", "max_score", "execution_time", "tests", "output", "visibility"}
    for test in results["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output", "visibility"}
        assert test["status"] in ("passed", "failed")
    feedback = (out / "carol" / "feedback.md").read_text()
    assert "element" in feedback and ", expected" not in feedback and "def test_" not in feedback
    dave = (out / "dave" / "feedback.md").read_text()
    assert "did not finish within 4 s" in dave
    flood = json.loads((out / "flood" / "results.json").read_text())
    assert len(flood["output"]) < 10_000 and "the last 1500 characters" in flood["output"]
    assert "could read" not in (out / "snoop" / "feedback.md").read_text()


@pytest.mark.timeout(700)
def test_cheating_is_refused_with_what_to_use_instead_or_flagged(batch):
    out, book, output = batch.out, batch.book, batch.output
    # refused at intake (the line named) or at run time, with what to use instead
    assert (
        "line " in book["library_call"]["reason"] and "minidist.allreduce" in book["library_call"]["reason"]
    )
    assert "refused at run time" in book["obfuscated_call"]["reason"]
    assert "torch.distributed" in book["torch_call"]["reason"]
    feedback = (out / "obfuscated_call" / "feedback.md").read_text()
    assert "What you may use instead: comm.send" in feedback
    forged = json.loads((out / "forged_stats" / "results.json").read_text())
    budget = next(t for t in forged["tests"] if t["name"] == "test_ring_allreduce_budget[3]")
    assert budget["status"] == "failed" and "over the budget" in budget["output"], budget
    # the copy of ring.py is graded normally, flagged for the instructor only
    assert float(book["ring_copy"]["similarity"]) >= similarity.FLAG_AT > float(book["alice"]["similarity"])
    assert book["ring_copy"]["similar_to"].startswith("lib/minidist/collectives/ring.py:")
    assert "flagged for review" in output and "ring_copy: similarity" in output
    assert "alice: similarity" not in output
    # the library copied at import (issue 25): the child reads the stand-in, the folder is not writable
    copied = json.loads((out / "copy_at_import" / "results.json").read_text())["output"]
    assert "read the stand-in, copied into the working directory: False" in copied, copied
    copy_results = (out / "ring_copy" / "results.json").read_text()
    assert "similar" not in copy_results + (out / "ring_copy" / "feedback.md").read_text()


@pytest.mark.timeout(700)
def test_a_rerun_resumes_and_regrades_to_the_same_gradebook(batch):
    # runs last on ``batch``: it grades the same folder again
    out, before = batch.out, (batch.out / "gradebook.csv").read_bytes()
    output = grade(batch.submissions, out, *EXAMPLE_OPTIONS)
    assert f"reusing {len(EXPECTED)} finished" in output
    assert (out / "gradebook.csv").read_bytes() == before
    # "interrupted": two results were never written; only those two are graded again, to the same grades
    for student in ("carol", "bob"):
        (out / student / "results.json").unlink()
    alice_before = (out / "alice" / "results.json").stat().st_mtime_ns
    output = grade(batch.submissions, out, *EXAMPLE_OPTIONS)
    assert f"reusing {len(EXPECTED) - 2} finished" in output
    assert (out / "alice" / "results.json").stat().st_mtime_ns == alice_before
    assert (out / "gradebook.csv").read_bytes() == before
    # a changed submission is graded again
    (batch.submissions / "bob" / "collectives.py").write_text(make.SOLUTION.read_text())
    grade(batch.submissions, out, *EXAMPLE_OPTIONS)
    assert gradebook(out)["bob"]["score"] == "6"


@pytest.mark.timeout(300)
def test_a_copy_of_the_library_does_not_reach_the_top_tier(tmp_path):
    """library_auto's fast_allreduce is md.allreduce(algorithm="auto") copied (ring or butterfly by
    the cost model): 1.98x the best textbook time on 4 ranks, 1.59x on 5, the third tier of both
    measured tests (``make.MEASURED``), on the leaderboards with those values; the feedback names
    what full points need. (The solution's top tier: ``test_solutions_and_stubs.py``.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    student = make.realistic(make.SOLUTION.read_text(), make.STUB.read_text())["library_auto"]
    write(submissions, {"library_auto": student})
    tests = [arg for name in make.MEASURED_TESTS for arg in ("--tests", glob.escape(name))]
    run_grader("a1_collectives", submissions, out, "--seed-key", "k", *tests, timeout=240)
    row = gradebook(out)["library_auto"]
    assert (row["status"], float(row["score"])) == ("ok", make.MEASURED["library_auto"]), row
    measured = json.loads((out / "library_auto" / "results.json").read_text())["extra_data"]["measured"]
    assert round(measured[make.MEASURED_TESTS[0]], 2) == 1.98, measured
    assert round(measured[make.MEASURED_TESTS[1]], 2) == 1.59, measured
    boards = sorted((out / "leaderboard").iterdir())
    assert len(boards) == 2 and all("\n1,library_auto," in board.read_text() for board in boards), boards
    assert "full points need at most 1\\.1x" in (out / "library_auto" / "feedback.md").read_text()


@pytest.mark.timeout(300)
def test_the_gradescope_bundle_grades_a_submission(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "grader", "gradescope", "a1_collectives", "--out", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    bundle = tmp_path / "a1_collectives-autograder.zip"
    source = tmp_path / "source"
    with zipfile.ZipFile(bundle) as archive:
        names = archive.namelist()
        archive.extractall(source)
    assert {
        "setup.sh",
        "run_autograder",
        "grader/a1_collectives/test_hidden.py",
        "lib/minidist/launch/__init__.py",
    } <= set(names)
    assert not any(name.startswith(("solutions/", "assignments/", "tests/")) for name in names)
    solution_line = "exchange(comm, chunk((rank - step) % p), right, chunk((rank - step - 1) % p), left)"
    assert solution_line in make.SOLUTION.read_text()
    assert not any(
        solution_line in (source / n).read_text(errors="replace") for n in names if not n.endswith("/")
    )
    assert "python -m grader grade a1_collectives" in (source / "run_autograder").read_text()
    # what run_autograder does, from the unpacked bundle
    submissions = tmp_path / "submissions" / "submission"
    submissions.mkdir(parents=True)
    (submissions / "collectives.py").write_bytes(make.SOLUTION.read_bytes())
    command = [sys.executable, "-m", "grader", "grade", "a1_collectives", str(submissions.parent)]
    command += ["--out", str(tmp_path / "out"), "--tests", "test_ring_allgather[[]3]"]
    result = subprocess.run(command, cwd=source, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "submission" / "results.json").read_text())
    assert results["score"] == results["max_score"] == 1
