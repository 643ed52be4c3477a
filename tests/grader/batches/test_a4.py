"""``python -m grader grade a4_compression``: the example students, graded once.

One batch on a subset of the hidden tests that tells the examples of
``grader/examples/a4_compression/make.py`` apart (``--jobs 2``, a fixed seed key), and olga, the
library's DGC, on the measured test alone (the copy of the library does not reach its top tier). The grader's
second DGC and the checks that cheats met: ``tests/grader/test_grade_a4.py``.
The solution and the stub on every hidden test: ``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from grade_helpers import (
    check_expected_scores,
    grade_examples,
    gradebook,
    run_grader,
)
from grader import grade, similarity
from grader.examples.a4_compression import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart (glob patterns: "[[]" is a literal "["): error feedback
#: (bob, ivan), the sampled selection (carol), the sequence with the whole sample (dave, bob,
#: gina, ivan), the bytes of the hook (erin, hank; and kate, liam, mona, nick, whose update is not
#: the mean of what they allgathered: the bytes test runs ``applied_check`` too); single-process
#: jobs but one. (gina's hidden loss and hank's convergence are checked by the tests of the
#: checks above, and by ``make.LOST`` on the whole hidden suite.)
SUBSET = (
    "test_select_sampled_threshold",
    "test_compress_sequence[[]whole]",
    "test_error_feedback_loses_nothing",
    "test_bytes_on_the_wire[[]2-pipe]",
)

SUBSET_NAMES = [
    "test_select_sampled_threshold",
    "test_compress_sequence[whole]",
    "test_error_feedback_loses_nothing",
    "test_bytes_on_the_wire[2-pipe]",
]


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a4_compression").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(400)
def test_the_examples_get_their_scores(tmp_path):
    # a fixed key: with some seeds the sampled threshold happens to pick exactly the top k,
    # and carol's exact top-k would then pass the tests it is meant to lose
    out, book = grade_examples(
        "a4_compression", make, SUBSET, tmp_path, "--test-timeout", "30", "--seed-key", "k"
    )
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "(everything sent) + (what is left in v)" in (out / "bob" / "feedback.md").read_text()
    assert "the recipe chooses" in (out / "carol" / "feedback.md").read_text()
    assert "KeyError" in (out / "erin" / "feedback.md").read_text()
    assert "allreduce" in (out / "hank" / "feedback.md").read_text()
    assert "between 1 and k" in (out / "ivan" / "feedback.md").read_text()
    for student in ("kate", "mona"):  # each rank steps on its own data: the ranks part
        assert "differs from rank 0's" in (out / student / "feedback.md").read_text(), student
    for student in ("liam", "nick"):  # a dense average through files: the ranks agree
        assert "not the mean of the payloads" in (out / student / "feedback.md").read_text(), student
    assert "minidist.parallel.compression" in book["frank"]["reason"]
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT


MEASURED = "test_bytes_to_target_loss[2-pipe]"


@pytest.mark.timeout(300)
def test_a_copy_of_the_library_does_not_reach_the_top_tier(tmp_path):
    """olga hands in the library's DGC with its default hook: about 370x fewer bytes than dense to
    the target loss, the second tier (``make.PARTIAL``), on the leaderboard with that value;
    the feedback names what full points need. (The solution's top tier:
    ``test_solutions_and_stubs.py``; the bytes are the transport's and the loss is replayed from
    the logged payloads, so the value does not depend on the load: held to the stored one.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, {"olga": make.build_dict()["olga"]})
    run_grader(
        "a4_compression", submissions, out, "--seed-key", "k", "--tests", glob.escape(MEASURED), timeout=240
    )
    olga = gradebook(out)["olga"]
    assert (olga["status"], float(olga["score"])) == ("ok", make.expected_score("olga", [MEASURED])), olga
    value = json.loads((out / "olga" / "results.json").read_text())["extra_data"]["measured"][MEASURED]
    assert 300 < value < 450, value  # 369.8x where it was written
    board = next((out / "leaderboard").iterdir()).read_text()
    assert "\n1,olga," in board, board
    assert "500x" in (out / "olga" / "feedback.md").read_text()
