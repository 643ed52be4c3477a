"""``python -m grader grade a5_model_parallel``: the example students and the stub, graded in one batch.

The graded tests are the hidden tests with their points; the grader's 1F1B, checker and
simulator (``grader/a5_model_parallel/reference.py``) agree with the solution and with the
formulas and refuse broken schedules; the checks refuse reports that cheat; the intake check and
the run time guard refuse the library's tensor and pipeline parallelism; and the example students
of ``grader/examples/a5_model_parallel/make.py`` (correct, GPipe for 1F1B, an extra allreduce, the
bias added p times, a crash, the library's layers, a deadlock, no f; and the red team's cheats: a
dense copy with allreduces of zeros, a forged order, frame walking, a module written at run time,
a dir_fd read of the library, zeros of the right size as traffic) and the released stub get
exactly their expected scores on a subset of the hidden tests that tells them apart (one batch,
``--jobs 2``, a fixed seed key).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader
from grader import similarity
from grader.examples.a5_model_parallel import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart (glob patterns: "[[]" is a literal "["): f and g
#: (carol), column (hank), row (dave), the MLP's allreduce count (carol, hank), the exact 1F1B and
#: the peak (bob), the stage step (erin, gina)
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


def grade(submissions: Path, out: Path, *extra: str) -> str:
    return run_grader("a5_model_parallel", submissions, out, *extra, timeout=500)


@pytest.mark.timeout(500)
def test_the_examples_and_the_stub_get_their_scores(tmp_path):
    submissions = tmp_path / "subs"
    make.write(submissions, make.build_dict())
    (submissions / "stub").mkdir()
    for name in make.FILES:
        (submissions / "stub" / name).write_bytes((make.STUB_FOLDER / name).read_bytes())
    out = tmp_path / "out"
    selection = [arg for pattern in SUBSET for arg in ("--tests", pattern)]
    grade(submissions, out, "--jobs", "2", "--test-timeout", "30", "--seed-key", "k", *selection)
    book = gradebook(out)
    assert (
        book["alice"]["score"]
        == book["alice"]["max_score"]
        == f"{make.expected_score('alice', SUBSET_NAMES):g}"
    )
    for student, (status, _) in make.LOST.items():
        score = make.expected_score(student, SUBSET_NAMES)
        assert (book[student]["status"], float(book[student]["score"])) == (status, score), book[student]
    assert book["stub"]["score"] == "0" and book["stub"]["status"] == "ok"
    stub = json.loads((out / "stub" / "results.json").read_text())
    assert all("NotImplementedError" in t["output"] and "TODO(task" in t["output"] for t in stub["tests"])
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
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT
