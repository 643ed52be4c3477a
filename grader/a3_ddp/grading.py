"""How ``python -m grader grade`` runs assignment 3: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the one-process training
and the buckets it must match (``reference.py``) are recomputed here from the same spec. The
sandbox gets ``workers.py`` and ``rules.py`` only: never ``test_hidden.py``, ``reference.py``,
the expected values or the points.
"""

from __future__ import annotations

from grader.forbidden import Rules
from grader.plan import (
    GradedTest,
    graded_tests_from_cases,
    import_failure_of,
    ranked_failure_message,
    redact_expected,
)

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
    return graded_tests_from_cases(hidden.cases(seed), WORKERS_MODULE)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    return ranked_failure_message(hidden, test, error, seconds)


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because ``ddp.py`` could not be imported."""
    return import_failure_of(error, "import_module(STUDENT_MODULE)")


#: what a student may see: the wrong value, not the expected one
redact = redact_expected
