"""``python -m grader grade a3_ddp``: the example students, graded once.

One batch on a subset of the hidden tests that tells the examples of
``grader/examples/a3_ddp/make.py`` apart (``--jobs 2``): among them the forged communications
(decoy allreduces, the real sum by another collective or by messages), each left with its honest
part, and a slip in the bucket rule that costs task 1 only. Then three forgeries run straight
into the hidden tests, past the intake check: the worker's own defences and the transport's
byte count catch them. The pieces (intake, guard, recorder, the trusted side's buckets, byte
formula and carried-gradient check): ``tests/grader/test_grade_a3.py``.
The solution and the stub on every hidden test: ``test_solutions_and_stubs.py``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grade_helpers import (
    check_expected_scores,
    grade_examples,
    gradebook,
    run_grader,
)
from grader import grade, similarity
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


def test_the_subset_is_in_the_case_table():
    names = {t.name for t in grade.load_assignment("a3_ddp").graded_tests(0)}
    assert set(SUBSET_NAMES) <= names


@pytest.mark.timeout(400)
def test_the_examples_get_their_scores(tmp_path):
    out, book = grade_examples("a3_ddp", make, SUBSET, tmp_path, "--test-timeout", "20")
    check_expected_scores(book, make, SUBSET_NAMES)
    assert "did not finish within 20 s" in (out / "dave" / "feedback.md").read_text()
    assert "nothing overlaps backward" in (out / "bob" / "feedback.md").read_text()
    assert "bucket 1 (in launch order)" in (out / "lazy" / "feedback.md").read_text()
    assert "no attribute 'phase'" in (out / "mallory" / "feedback.md").read_text()
    assert "which is wrong" in (out / "carol" / "feedback.md").read_text()
    assert "minidist.DistributedDataParallel" in book["frank"]["reason"]
    assert float(book["alice"]["similarity"]) < similarity.FLAG_AT
    # each forgery is caught by what it forged, not by chance
    for student, reason in (
        ("decoy", "md.broadcast, md.reduce called during training"),
        ("overwrite", "md.broadcast, md.reduce called during training"),
        ("whisper", "message(s) sent and"),
        ("mimic", "md.allgather called during training"),
        ("echo", "one per bucket"),
    ):
        assert reason in (out / student / "feedback.md").read_text(), student
    assert "_comm" in book["oscar"]["reason"]


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
    # oscar's messages on the transport's own communicator: no collective, no message on the
    # communicator it was given; its decoy allreduces carry no bucket's gradient, which is checked
    # first (the transport's byte count, checked after, is tested in test_grade_a3.py)
    oscar = hidden_tests_on(tmp_path / "oscar", "test_one_allreduce_per_bucket and deep")
    assert "1 failed" in oscar and "no allreduce carried bucket" in oscar, oscar[-3000:]


MEASURED = "test_step_time[timed-2-1gbit]"


@pytest.mark.timeout(300)
def test_a_copy_of_the_library_does_not_reach_the_top_tier(tmp_path):
    """lena hands in the library's DDP as it is (its bucket rule, launch order and default cap of
    1 MiB): 1.23x the lower bound on the emulated clock, the second tier (``make.PARTIAL``), on
    the leaderboard with that value; the feedback names what full points need. (The solution's
    top tier, 1.03x: ``test_solutions_and_stubs.py``; the value is replayed from the order of
    events, so two gradings give the same.)"""
    submissions, out = tmp_path / "subs", tmp_path / "out"
    make.write(submissions, {"lena": make.build_dict()["lena"]})
    run_grader("a3_ddp", submissions, out, "--tests", glob.escape(MEASURED), timeout=240)
    lena = gradebook(out)["lena"]
    assert (lena["status"], float(lena["score"])) == ("ok", make.expected_score("lena", [MEASURED])), lena
    value = json.loads((out / "lena" / "results.json").read_text())["extra_data"]["measured"][MEASURED]
    assert abs(value - 1.2313) < 1e-3, value  # 1.23126x where it was written
    board = next((out / "leaderboard").iterdir()).read_text()
    assert "\n1,lena," in board, board
    assert "full points need at most 1\\.05x" in (out / "lena" / "feedback.md").read_text()
