"""``python -m grader grade a5_model_parallel``: the example students, graded once.

One batch on a subset of the hidden tests that tells the examples of
``grader/examples/a5_model_parallel/make.py`` apart, the red team's cheats included (``--jobs 2``,
a fixed seed key). The grader's schedules, checker and simulator, and the checks that cheats
met: ``tests/grader/test_grade_a5.py``.
The solution and the stub on every hidden test: ``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from grade_helpers import (
    check_expected_scores,
    grade_examples,
    gradebook,
    run_grader,
)
from grader import grade, similarity
from grader.examples.a5_model_parallel import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart (glob patterns: "[[]" is a literal "["): f and g
#: (carol), column (hank), row (dave), the MLP's allreduce count (carol, hank), the exact 1F1B and
#: the peak (bob), the stage step (erin, gina, and issue 25's replays)
SUBSET = (
    "test_conjugate_operators[[]2]",
    "test_column_parallel[[]column-2]",
    "test_row_parallel[[]row-2]",
    "test_mlp_allreduce_count[[]2]",
    "test_one_f_one_b_exact",
    "test_schedule_peak_in_flight",
    "test_run_stage[[]2-1f1b]",
)

SUBSET_NAMES = [pattern.replace("[[]", "[") for pattern in SUBSET]


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a5_model_parallel").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(500)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples(
        "a5_model_parallel", make, SUBSET, tmp_path, "--test-timeout", "30", "--seed-key", "k"
    )
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "not the 1F1B schedule" in (out / "bob" / "feedback.md").read_text()
    assert "call(s) of md.allreduce" in (out / "carol" / "feedback.md").read_text()
    assert "differs from the dense model" in (out / "dave" / "feedback.md").read_text()
    assert "KeyError" in (out / "erin" / "feedback.md").read_text()
    assert "did not finish" in (out / "gina" / "feedback.md").read_text()
    assert "the input's gradient" in (out / "hank" / "feedback.md").read_text()
    assert "minidist.parallel.tensor" in book["frank"]["reason"]
    # the red team's six ways, closed (the scores: ``make.LOST``)
    assert "tb_frame" in book["frame_walk"]["reason"]
    assert "dir_fd" in book["dirfd_read"]["reason"]
    assert "late_schedule.py" in book["late_module"]["reason"]
    assert "this rank's share" in (out / "dense_copy" / "feedback.md").read_text()
    assert "their microbatches" in (out / "forged_order" / "feedback.md").read_text()
    # zeros for gradients: stage 0's gradients are wrong before what was sent is compared
    # (test_the_executor_check_compares_what_was_sent_and_which_microbatch_ran checks that part)
    assert "the gradient of parameter" in (out / "padded_traffic" / "feedback.md").read_text()
    # issue 25: the real work on layers the stage does not count, the schedule replayed on it. The
    # stage has no layers to find, so each falls back on the stage: its GPipe pass is counted (the
    # order), or the replay's zeros and the copy's own weights show (the gradients)
    for student in ("inner_replay", "modules_replay"):
        assert "in the order of the schedule" in (out / student / "feedback.md").read_text()
    for student in ("functional_replay", "kept_replay"):
        assert "the gradient of parameter" in (out / student / "feedback.md").read_text()
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT


@pytest.mark.timeout(300)
def test_the_measured_schedules_get_their_tiers(tmp_path):
    """The measured test alone (``make.TIERED``): the solution's zero-bubble schedule at the top tier,
    1F1B with each backward split at once in the middle, a copy of the library's 1F1B at the
    lowest, GPipe over the memory cap nothing; each value in the leaderboard. (The order is
    timed on the trusted side in units, so each value equals the stored one under any load.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, make.build_tiered_dict())
    selection = [arg for name in make.TIERED_NAMES for arg in ("--tests", name.replace("[", "[[]"))]
    run_grader(
        "a5_model_parallel", submissions, out, "--jobs", "2", "--seed-key", "k", *selection, timeout=280
    )
    book = gradebook(out)
    (board,) = (out / "leaderboard").glob("*.csv")
    lines = [line for line in board.read_text().splitlines() if not line.startswith("#")]
    values = {row["id"]: float(row["value"]) for row in csv.DictReader(lines)}
    for student, (status, _) in make.TIERED.items():
        want = make.tiered_score(student, make.TIERED_NAMES)
        assert (book[student]["status"], float(book[student]["score"])) == (status, want), book[student]
        assert values.get(student) == make.TIERED_VALUES[student], (student, values)
    feedback = (out / "library_copy" / "feedback.md").read_text().replace("\\", "")
    assert "1.375x, tier 3 of 3" in feedback and "full points need at most 1.13x" in feedback
    assert "the cap is p = 4" in (out / "over_cap" / "feedback.md").read_text()
