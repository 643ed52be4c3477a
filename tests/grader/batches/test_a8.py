"""``python -m grader grade a8_experts``: the example students, graded once.

One batch on the subset of hidden tests that tells the examples of
``grader/examples/a8_experts/make.py`` apart (``--jobs 2``, 8 s a test): the equal all-to-all
over pipes with a piece larger than a pipe's buffer (the blocking sender deadlocks there), the
router (the off-by-one capacity), and the measured bytes per token (which also holds the layer's
output and gradients to one process: the forgotten backward). The solution scores the top tier,
a copy of the library's ExpertParallelMoE the second, GShard's padded layout the third, and so
does a padded layout that rewrites what its communicator reports (the transport's counters are
read); two are refused at intake (``md.all_to_all``, the library's router); two exact layers
that never send the tokens to the experts in the forward (one rebuilds the other ranks' inputs
from the seeds and sends nothing, one ships the experts while the layer is built) fail the
measured test on the transcript check. The solution and the stub on every hidden test:
``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import json

import pytest

from grade_helpers import check_expected_scores, grade_examples
from grader import grade
from grader.examples.a8_experts import make

SUBSET = ("test_exchange_equal*", "test_routing", "test_bytes_per_token*")
SUBSET_NAMES = ["test_exchange_equal[3-pipe]", "test_routing", "test_bytes_per_token[2-shm]"]


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a8_experts").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(400)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples("a8_experts", make, SUBSET, tmp_path, "--test-timeout", "8")
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "all_to_all" in book["frank"]["reason"]
    assert "minidist.parallel.experts" in book["mo"]["reason"]
    for student in ("oracle", "prefetch"):  # exact values, but the rows never travelled
        results = json.loads((out / student / "results.json").read_text())
        test = next(t for t in results["tests"] if t["name"] == "test_bytes_per_token[2-shm]")
        assert "never reached rank" in test["output"], test
    dan = json.loads((out / "dan" / "results.json").read_text())
    assert "did not finish" in next(
        t["output"] for t in dan["tests"] if t["name"].startswith("test_exchange")
    )
    measured = {}
    for student in ("alice", "lena", "gina", "forger"):
        results = json.loads((out / student / "results.json").read_text())
        measured[student] = results["extra_data"]["measured"]["test_bytes_per_token[2-shm]"]
    # counted by the transport, not timed: the values stored where they were written (rows of d
    # float64s per token; floors 3.875, 7.3125, 16 from the routing, make.py says what is added)
    stored = {"alice": 3.9963, "lena": 7.3135, "gina": 16.0005, "forger": 16.0005}
    assert {student: round(value, 4) for student, value in measured.items()} == stored, measured
    lines = (out / "leaderboard" / "test_bytes_per_token_2-shm.csv").read_text().splitlines()
    rows = [line.split(",") for line in lines if not line.startswith("#")]
    assert rows[0][:2] == ["rank", "id"] and rows[1][1] in ("alice", "dan", "olga"), lines
