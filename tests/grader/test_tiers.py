"""``grader/tiers.py`` and what the grader makes of a measured test: points by tier, feedback, leaderboards.

The measured tasks themselves (what each assignment measures, that the solution reaches the top
tier and a copy of the library's version does not, that two gradings agree) are checked by each
assignment's batch tests and ``tests/grader/batches/test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import csv
import json
import math

import pytest

from grader import plan, report
from grader.tiers import Tiers, leaderboard_rows

STEP = Tiers("step time / bound", "x", ((1.1, 1.0), (1.3, 0.5), (2.0, 0.25)), baseline="the library: 1.31x")
RATIO = Tiers("compression ratio", "x", ((100.0, 1.0), (30.0, 0.4)), lower_is_better=False)


@pytest.mark.parametrize(
    "tiers, value, fraction, tier",
    [
        (STEP, 1.0, 1.0, 1),
        (STEP, 1.1, 1.0, 1),  # a bound is met by the value equal to it
        (STEP, 1.1000001, 0.5, 2),
        (STEP, 1.31, 0.25, 3),
        (STEP, 2.5, 0.0, 0),
        (RATIO, 250.0, 1.0, 1),
        (RATIO, 99.0, 0.4, 2),
        (RATIO, 29.0, 0.0, 0),
    ],
)
def test_a_value_earns_the_fraction_of_the_first_level_it_meets(tiers, value, fraction, tier):
    outcome = tiers.outcome(value, 8)
    assert (outcome.fraction, outcome.tier) == (fraction, tier)
    assert tiers.fmt(value) in outcome.message
    if tier != 1:  # below the top: what full points need, and what the library's version reaches
        assert "full points need" in outcome.message
        assert not tiers.baseline or f"for comparison, {tiers.baseline}" in outcome.message


@pytest.mark.parametrize("value", [math.nan, math.inf, "1.0", None, True])
def test_anything_but_a_finite_number_earns_nothing(value):
    outcome = STEP.outcome(value, 8)
    assert outcome.fraction == 0 and outcome.tier == 0 and "no finite measurement" in outcome.message


@pytest.mark.parametrize(
    "levels, lower",
    [
        ((), True),
        (((1.3, 1.0), (1.1, 0.5)), True),  # worse bound first
        (((1.1, 1.0), (1.1, 0.5)), True),  # equal bounds
        (((1.1, 0.9), (1.3, 0.5)), True),  # the top tier is not full points
        (((1.1, 1.0), (1.3, 1.2)), True),  # fractions must fall
        (((1.1, 1.0), (2.0, 0.0)), True),  # a level worth nothing
        (((30.0, 1.0), (100.0, 0.4)), False),  # higher is better: bounds fall
    ],
)
def test_levels_go_best_first_with_falling_fractions(levels, lower):
    with pytest.raises(ValueError):
        Tiers("q", "x", levels, lower_is_better=lower)


def test_the_leaderboard_ranks_best_first_and_ties_share_a_rank():
    rows = leaderboard_rows([("b", 1.2, 4), ("a", 1.2, 4), ("c", 1.05, 8), ("d", 1.9, 2)], STEP)
    assert [(r["rank"], r["id"]) for r in rows] == [(1, "c"), (2, "a"), (2, "b"), (4, "d")]
    rows = leaderboard_rows([("x", 50.0, 3), ("y", 120.0, 8)], RATIO)
    assert [r["id"] for r in rows] == ["y", "x"]


def graded(student: str, value: float | None, points: float) -> report.Graded:
    tests = [
        plan.TestResult("test_right", 2, 2, True, "f"),
        plan.TestResult("test_wrong", 0, 3, False, "g", message="g failed: wrong sum"),
        plan.TestResult(
            "test_step[deep-2]",
            points,
            8,
            points == 8,
            "h",
            message="" if value is None else STEP.outcome(value, 8).message,
            measured=value,
            quantity=STEP.quantity,
            order=STEP.order,
        ),
    ]
    return report.Graded(student, "ok", "", tests, 1.0, "digest")


def test_results_json_and_feedback_carry_the_measured_value_and_the_leaderboard():
    partial = graded("ann", 1.2, 4)
    data = report.results_json(partial)
    assert data["score"] == 6 and data["max_score"] == 13
    assert data["leaderboard"] == [{"name": STEP.quantity, "value": 1.2, "order": "asc"}]
    assert data["extra_data"]["measured"] == {"test_step[deep-2]": 1.2}
    feedback = report.feedback_md(partial, {})
    measured, failed = feedback.split("## What failed")[0], feedback.split("## What failed")[1]
    assert "## Measured" in measured and "tier 2 of 3" in measured and "full points need" in measured
    assert "test_wrong" in failed and "test_step" not in failed  # a tier is not a failure
    wrong = report.results_json(graded("bob", None, 0))  # a wrong result: no value, no leaderboard entry
    assert wrong["leaderboard"] == [] and wrong["extra_data"]["measured"] == {"test_step[deep-2]": None}
    assert "test_step" in report.feedback_md(graded("bob", None, 0), {}).split("## What failed")[1]
    json.dumps(data, allow_nan=False)
    right = report.Graded("cid", "ok", "", [partial.tests[0], partial.tests[2]], 1.0, "d")  # no failure
    assert "Well done" not in report.feedback_md(right, {}) and "top tier needs" in report.feedback_md(
        right, {}
    )
    full = report.Graded("dan", "ok", "", [partial.tests[0]], 1.0, "d")
    assert "Every test passed. Well done." in report.feedback_md(full, {})


def test_the_grader_writes_a_leaderboard_per_measured_test(tmp_path):
    results = {
        "ann": report.results_json(graded("ann", 1.2, 4)),
        "cid": report.results_json(graded("cid", 1.04, 8)),
        "bob": report.results_json(graded("bob", None, 0)),  # wrong: not on the board
        "eve": {"extra_data": {"measured": {"test_step[deep-2]": "1e-9"}}},  # damaged: not on the board
    }
    report.write_leaderboards(tmp_path, results, {"test_step[deep-2]": STEP})
    path = tmp_path / "leaderboard" / "test_step_deep-2.csv"
    lines = path.read_text().splitlines()
    assert lines[0] == f"# {STEP.quantity} (lower is better)"
    rows = list(csv.DictReader(lines[1:]))
    assert [(r["rank"], r["id"], r["value"], r["points"]) for r in rows] == [
        ("1", "cid", "1.04", "8"),
        ("2", "ann", "1.2", "4"),
    ]
