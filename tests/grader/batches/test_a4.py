"""``python -m grader grade a4_compression``: the example students and the stub, graded in one batch.

The graded tests are the hidden tests with their points; the grader's second DGC
(``grader/a4_compression/reference.py``) agrees with the library's on random data; the example
students of ``grader/examples/a4_compression/make.py`` (correct, no error feedback, an exact
top-k instead of the sampled threshold, no momentum correction, a crash, the library's
compressor, a hidden loss, a dense hook, a compress_step that never sends) and the released
stub get exactly their expected scores on a subset of the hidden tests that tells them apart
(one batch, ``--jobs 2``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader
from grader import similarity
from grader.examples.a4_compression import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart (glob patterns: "[[]" is a literal "["): error feedback
#: (bob, ivan), the sampled selection (carol), the sequence with the whole sample (dave, bob,
#: gina, ivan), the bytes of the hook (erin, hank); single-process jobs but one. (gina's hidden
#: loss and hank's convergence are checked by the tests of the checks above, and by
#: ``make.LOST`` on the whole hidden suite.)
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


def grade(submissions: Path, out: Path, *extra: str) -> str:
    return run_grader("a4_compression", submissions, out, *extra, timeout=400)


@pytest.mark.timeout(400)
def test_the_examples_and_the_stub_get_their_scores(tmp_path):
    submissions = tmp_path / "subs"
    make.write(submissions, make.build_dict())
    (submissions / "stub").mkdir()
    (submissions / "stub" / make.FILE).write_bytes(make.STUB.read_bytes())
    out = tmp_path / "out"
    selection = [arg for pattern in SUBSET for arg in ("--tests", pattern)]
    # a fixed key: with some seeds the sampled threshold happens to pick exactly the top k,
    # and carol's exact top-k would then pass the tests it is meant to lose
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
    assert "(everything sent) + (what is left in v)" in (out / "bob" / "feedback.md").read_text()
    assert "the recipe chooses" in (out / "carol" / "feedback.md").read_text()
    assert "KeyError" in (out / "erin" / "feedback.md").read_text()
    assert "allreduce" in (out / "hank" / "feedback.md").read_text()
    assert "between 1 and k" in (out / "ivan" / "feedback.md").read_text()
    assert "minidist.parallel.compression" in book["frank"]["reason"]
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT
