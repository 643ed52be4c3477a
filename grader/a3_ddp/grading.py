"""How ``python -m grader grade`` runs assignment 3: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the one-process training
and the buckets it must match (``reference.py``) are recomputed here from the same spec. The
sandbox gets ``workers.py`` and ``rules.py`` only: never ``test_hidden.py``, ``reference.py``,
the expected values or the points.
"""

from __future__ import annotations

import re

from grader.forbidden import Rules
from grader.plan import GradedTest, Job

from . import STUDENT_FILES, rules
from . import test_hidden as hidden

__all__ = [
    "STUDENT_FILES",
    "SANDBOX_FILES",
    "FORBIDDEN",
    "SIMILAR_TO",
    "GIVEN_FUNCTIONS",
    "graded_tests",
    "failure_message",
    "import_failure",
    "redact",
    "HINTS",
]

#: files of this folder the sandbox needs (workers, and the rules their guard enforces); never test_hidden.py
SANDBOX_FILES = ("workers.py", "rules.py")
#: what a submission may not use (``rules.py``): refused at intake and, in the sandbox, at run time
FORBIDDEN = Rules.of(rules)
#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = ("lib/minidist/parallel/ddp.py", "lib/minidist/parallel/buckets.py")
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = (  # methods as ``Class.method``, the names grader/similarity.py gives them
    "call_when_backward_ends",
    "broadcast_parameters",
    "Bucket.of",
    "Bucket.reset",
    "Bucket.slot",
    "Bucket.nbytes",
    "BucketedDDP.__init__",
    "BucketedDDP.__call__",
    "BucketedDDP.parameters",
)
WORKERS_MODULE = "workers"

HINTS = {
    "assign_buckets": "Trainable parameters once each, reversed; close a bucket before it goes over.",
    "_on_gradient_ready": "Copy param.grad into its slot; a bucket's last gradient launches its allreduce.",
    "_launch": "recorder.begin(...) at the launch, recorder.end(token) when wait() returns.",
    "_finish_backward": "Launch what is left (unused: zeros); wait in order, divide by p, copy back.",
    "no_sync": "A flag the hook reads; restore it in a finally block.",
}


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    return [
        GradedTest(
            case.name,
            case.points,
            case.function,
            Job(WORKERS_MODULE, case.worker, case.world_size, case.args, case.transport),
            case.check,
        )
        for case in hidden.cases(seed)
    ]


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    job, text = test.job, str(error.get("text", ""))
    if error.get("kind") == "timeout":
        return hidden.timeout_failure(test.function, job.world_size, job.transport, seconds, text)
    if error.get("kind") == "worker":
        exc_type, summary = str(error.get("exc_type", "")), str(error.get("summary", ""))
        return hidden.worker_failure(
            test.function, job.world_size, job.transport, exc_type, error.get("rank", "?"), summary, text
        )
    return f"{test.function}: the test harness failed: {text}"


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because ``ddp.py`` could not be imported."""
    text, exc_type = str(error.get("text", "")), str(error.get("exc_type", ""))
    if error.get("kind") != "worker":
        return None
    if (
        exc_type in ("ImportError", "ModuleNotFoundError", "SyntaxError")
        or "import_module(STUDENT_MODULE)" in text
    ):
        return f"{exc_type or 'the process died'}: {str(error.get('summary', ''))[:200]}"
    return None


#: ", expected <value>" up to a following " (N of M elements differ)" or the end of the line
_EXPECTED_VALUE = re.compile(r", expected (?:(?! \(\d+ of )[^\n])*")


def redact(message: str) -> str:
    """What a student may see: the wrong value, not the expected one."""
    return _EXPECTED_VALUE.sub(", which is wrong", message)
