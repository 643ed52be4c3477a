"""``python -m grader grade a3_ddp``: assignment 3 goes through the same pipeline as a1 and a2.

The graded tests are the hidden tests with their points; the example students of
``grader/examples/a3_ddp/make.py`` (correct, no overlap, sums instead of averaging, a deadlock on
unused parameters, a crash, the library's DDP, only the first bucket overlapping, a forged clock,
a relabelled phase) and the released stub get exactly their expected scores on a subset of the
hidden tests that tells them all apart (one batch, ``--jobs 2``). The forgeries are also run
past the intake check, straight into the hidden tests: the worker's own defences catch them.

Fast: the grading batch of the examples is ``tests/grader/batches/test_a3.py``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grader import forbidden, similarity
from grader.a3_ddp.grading import ASSIGNMENT as assignment

ROOT = Path(__file__).resolve().parents[2]


def test_the_case_table_holds_the_tests_this_file_grades():
    graded = assignment.graded_tests(seed=12345)
    names = [t.name for t in graded]
    assert len(names) >= 12


def test_feedback_never_shows_expected_values():
    message = "m: rank 0, 'w': element (3, 1) is 0.125, expected 0.25 (4 of 10 elements differ)"
    assert "0.25" not in assignment.redact(message) and "0.125" in assignment.redact(message)
    assert "(4 of 10 elements differ)" in assignment.redact(message)
    buckets = "assign_buckets, case 2 (...): the buckets are [['a'], ['b']], expected [['b', 'a']]"
    assert "['b', 'a']" not in assignment.redact(buckets) and "[['a'], ['b']]" in assignment.redact(buckets)


def test_the_intake_check_accepts_the_solution_and_refuses_the_delegations():
    rules = assignment.forbidden
    assert forbidden.check((ROOT / "solutions/a3_ddp/ddp.py").read_text(), rules) is None
    for code in (
        "import minidist as md\nwrapped = md.DistributedDataParallel",
        "from minidist.parallel.ddp import DistributedDataParallel",
        "import torch\nwrapped = torch.nn.parallel.DistributedDataParallel",
        "from torch.nn.parallel import DistributedDataParallel",
        "import torch.distributed as dist",
        "from minidist.parallel.buckets import allreduce_average",
        "import minidist as md\nreduce = md.parallel.buckets.allreduce_average",
        # the grader's recorder: its state is private, and a bound method leads nowhere
        "class D:\n    def f(self):\n        self.recorder._phase.append(-1)\n",
        "class D:\n    def f(self):\n        self.recorder.begin.__self__._spans.clear()\n",
    ):
        assert forbidden.check(code, rules) is not None, code


GUARD_PROBE = """
import enum

import torch

import minidist as md
from grader import guard
from grader.a3_ddp import rules


def OneRank():  # enough of a communicator for a 1-rank allreduce, which sends nothing
    from minidist.transport.base import BaseComm

    return BaseComm(rank=0, world_size=1)


guard.install_rules(rules)
guard.install(("forbidden_demo",), (), "nothing")  # a forbidden module that defines an Enum
refused = []
for make in (
    lambda: md.DistributedDataParallel(torch.nn.Linear(2, 2), None),
    lambda: torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2)),
    lambda: __import__("forbidden_demo").helper(),
):
    try:
        make()
    except PermissionError as error:
        refused.append(guard.MARKER in str(error))
assert refused == [True, True, True], refused
# the module's Enum inherits enum.Enum.__new__, shared by every Enum: it must stay untouched
assert enum.Enum("Colour", "RED").RED.name == "RED"
ones = torch.ones(3)
assert md.allreduce(OneRank(), ones, op="sum", async_op=True).wait() is ones  # allowed, still works
print("ok")
"""


def test_the_run_time_guard_refuses_both_ddps_and_leaves_the_rest_alone(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(GUARD_PROBE)
    (tmp_path / "forbidden_demo.py").write_text(
        "import enum\n\n\nclass Mode(enum.Enum):\n    A = 1\n\n\ndef helper():\n    return Mode.A\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    result = subprocess.run(
        [sys.executable, str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("assignment", ["a1_collectives", "a2_async", "a3_ddp", "a4_compression"])
def test_given_functions_name_functions_of_the_solution(assignment):
    # similarity skips the given functions by the names it gives them (``Class.method`` for
    # methods); a bare method name would never match and the given code would be compared
    package = importlib.import_module(f"grader.{assignment}")
    grading_module = importlib.import_module(f"grader.{assignment}.grading")
    root = Path(__file__).resolve().parents[2] / "solutions" / assignment
    names = set()
    for student_file in package.STUDENT_FILES:
        names |= set(similarity.functions((root / student_file).read_text()))
    assert set(grading_module.GIVEN_FUNCTIONS) <= names, set(grading_module.GIVEN_FUNCTIONS) - names


def test_the_recorder_a_submission_gets_leads_nowhere():
    # begin and end only (slots, no __dict__); each record holds a copy of the phase
    from grader.a3_ddp import workers

    log = workers.SpanLog()
    recorder = log.recorder()
    assert [name for name in dir(recorder) if not name.startswith("_")] == ["begin", "end"]
    assert not hasattr(recorder, "__dict__") and not hasattr(recorder, "phase")
    log._phase = (2, 1)
    recorder.end(recorder.begin("allreduce bucket 0", cat="comm", bytes=64))
    (span,) = log._spans
    assert span["phase"] == [2, 1] and span["bytes"] == 64 and span["begin_ns"] <= span["end_ns"]
    span["phase"].append(-1)  # changing one record's phase changes no other and not the log's
    assert log._phase == (2, 1)


def test_tasks_2_to_4_use_the_students_own_buckets_when_they_are_a_partition():
    from grader.a3_ddp import reference, workers

    spec = {"model": "mixed", "seed": 3, "bucket_mb": 4096 / reference.MIB, "ranks": 2}
    right, _ = reference.expected_buckets(spec)
    assert reference.own_buckets(spec, right) == (right, "its buckets (ddp.buckets)")
    # a slip in the rule (not reversed) is still a partition within bucket_mb: held to its own
    model = workers.make_model(spec)
    forward = reference.reference_buckets(list(reversed(list(model.named_parameters()))), spec["bucket_mb"])
    assert forward != right and reference.own_buckets(spec, forward)[0] == forward
    # the tied weight under its second name is the same parameter
    tied = [["head.weight" if name == "embed.weight" else name for name in bucket] for bucket in right]
    assert tied != right and reference.own_buckets(spec, tied)[0] == right
    everything = [[name for bucket in right for name in bucket]]  # one bucket over bucket_mb
    frozen = [*right, ["proj.weight"]]
    twice = [*right, [right[0][0]]]
    missing = right[1:]
    for wrong in (everything, frozen, twice, missing, [], "x", [["nope"]]):
        assert reference.own_buckets(spec, wrong)[0] == right, wrong


def _traffic_of_each_algorithm(comm, sizes):
    import minidist as md

    out = []
    for algorithm in ("star", "tree", "ring", "butterfly", "auto"):
        for numel in sizes:
            before = comm.stats.copy()
            md.allreduce(comm, torch.ones(numel, dtype=torch.float64), algorithm=algorithm)
            sent = comm.stats - before
            out.append([algorithm, numel, sent.bytes_sent, sent.messages_sent])
    return out


def test_the_byte_and_message_formula_is_what_the_transport_counts():
    import minidist as md
    from grader.a3_ddp import reference

    sizes = [1, 5, 132, 1320]
    for ranks in (2, 3):
        run = _traffic_of_each_algorithm
        outs = md.launch(run, ranks, args=(sizes,), transport="pipe", start_method="fork", timeout=60)
        spec = {"ranks": ranks, "transport": "pipe"}
        for rank, rows in enumerate(outs):
            for algorithm, numel, sent, messages in rows:
                call = {"numel": numel, "itemsize": 8, "algorithm": algorithm}
                expected = reference.allreduce_traffic(spec, rank, call)
                assert (sent, messages) == expected, (ranks, rank, algorithm, numel)
    call = {"numel": 1320, "itemsize": 8, "algorithm": "auto"}
    assert reference.allreduce_traffic({"ranks": 3, "transport": "shm"}, 1, call) == (0, 0)


def test_an_allreduce_must_carry_the_bucket_gradient_or_its_average_share():
    from grader.a3_ddp import reference

    gradient = torch.arange(6, dtype=torch.float64)
    assert reference._carries({"carried": gradient.clone()}, gradient, 3)
    assert reference._carries({"carried": gradient / 3}, gradient, 3)  # averaged before the sum
    for carried in (torch.zeros(6, dtype=torch.float64), gradient * 2, gradient.flip(0), gradient[:5], None):
        assert not reference._carries({"carried": carried}, gradient, 3), carried
