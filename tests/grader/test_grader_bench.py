"""``python -m grader.bench``'s arithmetic, on batches made by hand (grading runs are too slow to
smoke-test here; the bench itself runs them).

The table's per-example numbers are means over copies and batches of each mode, the ratio is
isolated / baseline, and a submission graded differently in two batches is reported.
"""

from __future__ import annotations

import json

import pytest

from grader import bench


def batch(mode: str, wall: float, rows: dict) -> bench.Batch:
    return bench.Batch(mode, wall, dict(rows))


def numbers(line: str) -> list[float]:
    return [float(word) for word in line.split()[1:]]


def test_copies_cycle_through_the_examples_and_name_them():
    names = list(bench.copies(7))
    assert names == ["alice000", "bob001", "carol002", "erin003", "frank004.zip", "alice005", "bob006"]
    assert [bench.example_of(n.split(".")[0]) for n in names[:5]] == [
        "alice",
        "bob",
        "carol",
        "erin",
        "frank",
    ]


def test_summary_means_and_ratios():
    batches = [
        batch("isolated", 8.0, {"alice0": ("alice", 6.0, 4.0, 3, "ok"), "bob1": ("bob", 2.0, 1.0, 1, "ok")}),
        batch("baseline", 4.0, {"alice0": ("alice", 3.0, 2.5, 3, "ok"), "bob1": ("bob", 1.0, 0.5, 1, "ok")}),
        batch("isolated", 12.0, {"alice0": ("alice", 8.0, 5.0, 3, "ok"), "bob1": ("bob", 4.0, 2.0, 1, "ok")}),
        batch("baseline", 4.0, {"alice0": ("alice", 5.0, 3.5, 3, "ok"), "bob1": ("bob", 1.0, 0.5, 1, "ok")}),
    ]
    lines = bench.summary(batches, jobs=2)
    rows = {line.split()[0]: numbers(line) for line in lines[1:-1]}
    # isolated, baseline, ratio, tests iso, tests base, rest iso, rest base
    assert rows["alice"] == pytest.approx([7.0, 4.0, 1.75, 4.5, 3.0, 2.5, 1.0], abs=0.005)
    assert rows["bob"] == pytest.approx([3.0, 1.0, 3.0, 1.5, 0.5, 1.5, 0.5], abs=0.005)
    assert rows["all"] == pytest.approx([5.0, 2.5, 2.0, 3.0, 1.75, 2.0, 0.75], abs=0.005)
    # wall per submission: isolated (8/2 + 12/2) / 2 = 5, baseline 2, ratio 2.5
    assert lines[-1].endswith("isolated 5.00 s, baseline 2.00 s, ratio 2.50")
    assert bench.differences(batches) == []


def test_a_grade_that_differs_between_batches_is_reported():
    same = {"alice0": ("alice", 1.0, 0.5, 3, "ok")}
    other = {"alice0": ("alice", 1.0, 0.5, 2, "timeout")}
    assert bench.differences([batch("isolated", 1, same), batch("baseline", 1, same)]) == []
    changed = bench.differences([batch("isolated", 1, same), batch("baseline", 1, other)])
    assert len(changed) == 1 and changed[0].startswith("alice0:")


def test_read_batch_takes_the_numbers_from_results_json(tmp_path):
    for student, seconds, tests, score in (("alice000", 5.5, 4.0, 87), ("erin003", 1.25, 0.0, 0)):
        (tmp_path / student).mkdir()
        result = {
            "score": score,
            "execution_time": seconds,
            "extra_data": {"status": "ok" if score else "import_error", "tests_seconds": tests},
        }
        (tmp_path / student / "results.json").write_text(json.dumps(result))
    read = bench.read_batch("isolated", 9.0, tmp_path)
    assert read.wall == 9.0 and read.mode == "isolated"
    assert read.rows == {
        "alice000": ("alice", 5.5, 4.0, 87.0, "ok"),
        "erin003": ("erin", 1.25, 0.0, 0.0, "import_error"),
    }
