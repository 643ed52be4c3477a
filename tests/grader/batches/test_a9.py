"""``python -m grader grade a9_resilient``: the example students, graded once.

One batch on the subset of hidden tests that tells the examples of
``grader/examples/a9_resilient/make.py`` apart (``--jobs 2``): the run that ends with averages in
flight (the forgotten flush), the elastic run with a gradient over a pipe's buffer and a death in
the middle of the exchange (the blocking sender deadlocks there, the average over every member
fails the replay), and the measured time to target (a weaker design earns the second tier, and so
the same design with the transport's counters' class patched to read 0 is refused: the seal). One is
refused at intake (``torch.optim.SGD``). The solution and the stub on every hidden test:
``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import json

import pytest

from grade_helpers import check_expected_scores, grade_examples
from grader import grade
from grader.examples.a9_resilient import make

SUBSET = ("test_streaming[[]2-pending*", "test_quorum[[]3-large*", "test_time_to_target*")
SUBSET_NAMES = [make.PENDING, make.LARGE, make.MEASURED]


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a9_resilient").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(400)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples("a9_resilient", make, SUBSET, tmp_path, "--test-timeout", "60")
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "torch.optim.SGD" in book["tom"]["reason"]
    dan = json.loads((out / "dan" / "results.json").read_text())
    assert "deadlock" in next(t["output"] for t in dan["tests"] if t["name"] == make.LARGE)
    ava = json.loads((out / "ava" / "results.json").read_text())
    assert "replay" in next(t["output"] for t in ava["tests"] if t["name"] == make.LARGE)
    measured = {}
    for student in ("alice", "lena", "gus"):
        results = json.loads((out / student / "results.json").read_text())
        measured[student] = results["extra_data"]["measured"][make.MEASURED]
    # counted by the transport and emulated, not timed: the values stored where they were written
    # (ms: steps x 0.1152 + bytes / 12.5 MB/s + messages x 0.5 ms)
    stored = {"alice": 7.144, "lena": 7.144, "gus": 15.216}
    assert {student: round(value, 3) for student, value in measured.items()} == stored, measured
    assert float(book["lena"]["similarity"]) > float(book["alice"]["similarity"])
    forger = json.loads((out / "forger" / "results.json").read_text())
    assert "tampered with" in next(t["output"] for t in forger["tests"] if t["name"] == make.MEASURED)
