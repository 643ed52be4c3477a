"""How ``python -m grader grade`` runs assignment 2: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with data seeds only this run knows) that the sandbox runs, and the
case's check, which runs here on the reports read back as JSON and ``.npy``: the references
(``reference.py``) are recomputed here from the same seeds. The sandbox gets ``workers.py``
only: never ``test_hidden.py``, ``reference.py``, the expected values or the points.
"""

from __future__ import annotations

import re

from grader.forbidden import Rules
from grader.plan import (
    GradedTest,
    graded_tests_from_cases,
    import_failure_of,
    ranked_failure_message,
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
SIMILAR_TO = (
    "lib/minidist/glove/trainers/param_server.py",
    "lib/minidist/glove/trainers/hogwild.py",
)
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = ("read_request",)
WORKERS_MODULE = "workers"

HINTS = {
    "staleness_aware_lr": "lr / max(1, staleness): staleness 0 and 1 both get the full rate.",
    "run_server": "Answer a pull with the rows, then the version; apply a push at once, then version += 1.",
    "ps_worker": "Push the version your pull returned; rows and grads in batch order; DONE at the end.",
    "hogwild_worker": "Your part is split(len(order), world_size, rank); batch_step on the shared tensors.",
}


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    return graded_tests_from_cases(hidden.cases(seed), WORKERS_MODULE)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    return ranked_failure_message(hidden, test, error, seconds)


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because ``async_ps.py`` could not be imported."""
    return import_failure_of(error, "import_module(STUDENT_MODULE)")


_EXPECTED_VALUE = re.compile(r"(is [^,(]+), expected [^(]+?( \(|$)")


def redact(message: str) -> str:
    """What a student may see: the wrong value, not the expected one."""
    return _EXPECTED_VALUE.sub(r"\1, which is wrong\2", message)
