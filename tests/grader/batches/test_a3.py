"""``python -m grader grade a3_ddp``: the example students and the stub, graded in one batch.

The graded tests are the hidden tests with their points; the example students of
``grader/examples/a3_ddp/make.py`` (correct, no overlap, sums instead of averaging, a deadlock on
unused parameters, a crash, the library's DDP, only the first bucket overlapping, a forged clock,
a relabelled phase) and the released stub get exactly their expected scores on a subset of the
hidden tests that tells them all apart (one batch, ``--jobs 2``). The forgeries are also run
past the intake check, straight into the hidden tests: the worker's own defences catch them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grade_helpers import gradebook, run_grader
from grader import similarity
from grader.examples.a3_ddp import make

ROOT = Path(__file__).resolve().parents[3]

#: the tests that tell the examples apart: buckets, equivalence on the model with tied, frozen
#: and unused parameters, overlap, accumulation (glob patterns: "[[]" is a literal "[")
SUBSET = (
    "test_assign_buckets",
    "test_matches_one_process[[]mixed-2-shm]",
    "test_overlap*",
    "test_no_sync_accumulates[[]deep-2-shm]",
)

SUBSET_NAMES = [
    "test_assign_buckets",
    "test_matches_one_process[mixed-2-shm]",
    "test_overlap[tied-2-shm]",
    "test_no_sync_accumulates[deep-2-shm]",
]


def grade(submissions: Path, out: Path, *extra: str) -> str:
    return run_grader("a3_ddp", submissions, out, *extra, timeout=400)


@pytest.mark.timeout(400)
def test_the_examples_and_the_stub_get_their_scores(tmp_path):
    submissions = tmp_path / "subs"
    make.write(submissions, make.build_dict())
    (submissions / "stub").mkdir()
    (submissions / "stub" / make.FILE).write_bytes(make.STUB.read_bytes())
    out = tmp_path / "out"
    selection = [arg for pattern in SUBSET for arg in ("--tests", pattern)]
    grade(submissions, out, "--jobs", "2", "--test-timeout", "20", *selection)
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
    assert "did not finish within 20 s" in (out / "dave" / "feedback.md").read_text()
    assert "nothing overlaps backward" in (out / "bob" / "feedback.md").read_text()
    assert "bucket 1 (in launch order)" in (out / "lazy" / "feedback.md").read_text()
    assert "no attribute 'phase'" in (out / "mallory" / "feedback.md").read_text()
    assert "which is wrong" in (out / "carol" / "feedback.md").read_text()
    assert "minidist.DistributedDataParallel" in book["frank"]["reason"]
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT


def hidden_tests_on(submission: Path, selection: str) -> str:
    """The hidden tests matching ``selection`` on ``submission``, with no intake check before."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(submission), str(ROOT)])}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "grader/a3_ddp",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        selection,
    ]
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True
    )
    return result.stdout + result.stderr


@pytest.mark.timeout(300)
def test_the_forgeries_fail_even_past_the_intake_check(tmp_path):
    # trent's replaced time.perf_counter_ns: the worker's clock was bound before the import, and
    # the overlap check orders events by sequence numbers; mallory's phase relabel: no phase to
    # reach. Each loses the test it forges, as the honest no-overlap / no no_sync would.
    make.write(tmp_path, make.build_dict())
    trent = hidden_tests_on(tmp_path / "trent", "test_overlap or test_trace_spans")
    assert "1 failed, 1 passed" in trent and "nothing overlaps backward" in trent, trent[-3000:]
    mallory = hidden_tests_on(tmp_path / "mallory", "test_no_sync_accumulates and deep")
    assert "1 failed" in mallory and "no attribute 'phase'" in mallory, mallory[-3000:]
