"""``python -m grader grade a7_zero``: the example students, graded once.

One batch on the subset of hidden tests that tells the examples of
``grader/examples/a7_zero/make.py`` apart (``--jobs 2``): ZeRO-2's values on 2 ranks and the
measured peak (which also holds ZeRO-3's shards to one process). The solution scores the top
tier, a copy of the library's ZeRO the second, a hoard of gathered weights kept beside the stack
(which the census of blocks holding weights does not see) the third; four are refused at intake
(the library's ZeroOptimizer, the profiler switched off, AdamW's moments in Python lists, the step
in a thread the profiler does not follow); a full AdamW on every rank behind ZeRO-2's two
collectives fails the values test on what its allgather carries. The solution and the stub on
every hidden test: ``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import json

import pytest

from grade_helpers import check_expected_scores, grade_examples
from grader import grade
from grader.examples.a7_zero import make

SUBSET = ("test_zero2_values[[]2-shm]", "test_peak_memory*")
SUBSET_NAMES = ["test_zero2_values[2-shm]", "test_peak_memory[2-shm]"]


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a7_zero").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(400)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples("a7_zero", make, SUBSET, tmp_path)
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "minidist.parallel.zero" in book["frank"]["reason"]
    assert "profiler" in book["pauser"]["reason"]
    assert "tolist" in book["lister"]["reason"]
    assert "threading" in book["threaded"]["reason"]
    sender = json.loads((out / "sender" / "results.json").read_text())["tests"]
    assert "allgather did not carry" in next(
        t["output"] for t in sender if t["name"].startswith("test_zero2")
    )
    measured = {}
    for student in ("alice", "lena", "hoarder"):
        results = json.loads((out / student / "results.json").read_text())
        measured[student] = results["extra_data"]["measured"]["test_peak_memory[2-shm]"]
    # the solution below the library's copy, the hoard above it: what each holds, not what it says
    assert measured["alice"] < measured["lena"] < measured["hoarder"], measured
    # counted from the allocator's events, not timed: the values stored where they were written
    stored = {"alice": 1.537, "lena": 1.806, "hoarder": 1.954}  # peak / (16 Psi / N)
    assert {student: round(value, 3) for student, value in measured.items()} == stored, measured
    lines = (out / "leaderboard" / "test_peak_memory_2-shm.csv").read_text().splitlines()
    rows = [line.split(",") for line in lines if not line.startswith("#")]
    # carol pads nothing, and the measured stack needs no padding: her stack is the solution's
    assert rows[0][:2] == ["rank", "id"] and rows[1][1] in ("alice", "carol"), lines
