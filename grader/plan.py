"""What an assignment tells the grader: the jobs the sandbox runs and the checks the grader runs.

An assignment ``grader/<name>/`` that ``python -m grader grade`` can grade has a module
``grading.py`` with:

* ``STUDENT_FILES``: the files a student hands in (everything else is ignored);
* ``SANDBOX_FILES``: files of ``grader/<name>/`` the sandbox needs (the workers' code and
  ``rules.py``; ``guard.py`` and ``student_comm.py`` are added for every assignment);
* ``FORBIDDEN``: a ``forbidden.Rules`` (from ``rules.py``): what a submission may not use;
* ``SIMILAR_TO``: globs of library files a submission is compared with (``similarity.py``),
  and ``GIVEN_FUNCTIONS``: the stub's given helpers, not compared;
* ``graded_tests(seed) -> list[GradedTest]``: every test, its points, its ``Job`` and its
  ``check``; ``seed`` is chosen by the grader per student and run;
* ``failure_message(test, error, seconds) -> str``: what to say when a job did not return;
* ``import_failure(error) -> str | None``: a summary when a job failed because the student's
  module could not be imported (every test failing so gives the status ``import_error``);
* ``redact(message) -> str``: remove what a student must not see (expected values);
* ``HINTS``: ``{function: one-line hint}`` for the feedback.

The split is the trust boundary: a ``Job`` runs with the student's code, in the sandbox; a
``check`` runs in the grader, never next to student code, on data read back in a format that
cannot execute code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Job:
    """``md.launch(module.worker, world_size, args=args, transport=transport)`` in the sandbox.

    ``args`` must be JSON: the sandbox receives the job as JSON, never as a pickle.
    """

    module: str
    worker: str
    world_size: int
    args: list[Any]
    transport: str = "shm"

    def as_json(self, job_id: str, timeout: float) -> dict:
        return {
            "id": job_id,
            "module": self.module,
            "worker": self.worker,
            "world_size": self.world_size,
            "args": self.args,
            "transport": self.transport,
            "timeout": timeout,
        }


@dataclass(frozen=True)
class GradedTest:
    """One hidden test: ``check(outs)`` raises (pytest.fail, AssertionError, ...) when it fails."""

    name: str
    points: float
    function: str  # the student function it exercises (for hints and the summary)
    job: Job
    check: Callable[[list], None]


@dataclass
class TestResult:
    name: str
    points: float
    max_points: float
    passed: bool
    function: str
    message: str = ""  # why it failed, already redacted
    seconds: float = 0.0


# --- pieces every ``grading.py`` shares --------------------------------------------------------------
#
# The assignments' ``grading.py`` differ in their tests, rules, hints and messages; what follows is
# the part they have in common, written once.  (It lives here, not in a module of its own, because
# ``gradescope.py`` bundles a fixed list of grader modules, and this one is in it.)


def graded_tests_from_cases(
    cases: Iterable[Any], workers_module: str, wrap: Callable[[Callable], Callable] | None = None
) -> list[GradedTest]:
    """One ``GradedTest`` per ``test_hidden.Case``, in order: its worker as a ``Job``, its check.

    ``wrap(case.check)``, if given, adapts the check to the list of reports ``md.launch`` returns
    (a one-process case checks ``outs[0]``).
    """
    return [
        GradedTest(
            case.name,
            case.points,
            case.function,
            Job(workers_module, case.worker, case.world_size, case.args, case.transport),
            case.check if wrap is None else wrap(case.check),
        )
        for case in cases
    ]


def ranked_failure_message(hidden: Any, test: GradedTest, error: dict, seconds: float) -> str:
    """``failure_message`` for hidden tests whose messages name the ranks and the transport.

    ``hidden.timeout_failure(function, world_size, transport, seconds, text)`` and
    ``hidden.worker_failure(function, world_size, transport, exc_type, rank, summary, text)``
    write the student-facing text; ``error`` is what the harness wrote.
    """
    job, text = test.job, str(error.get("text", ""))
    if error.get("kind") == "timeout":
        return hidden.timeout_failure(test.function, job.world_size, job.transport, seconds, text)
    if error.get("kind") == "worker":
        exc_type, summary = str(error.get("exc_type", "")), str(error.get("summary", ""))
        return hidden.worker_failure(
            test.function, job.world_size, job.transport, exc_type, error.get("rank", "?"), summary, text
        )
    return f"{test.function}: the test harness failed: {text}"


#: the exceptions that say "the student's module did not import"
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError", "SyntaxError")


def import_failure_of(error: dict, marker: str) -> str | None:
    """A one-line summary when a job failed because the student's module could not be imported.

    The failure counts as one when the exception is an import or syntax error, or when the
    traceback ``text`` shows the worker's import line (``marker``, e.g. ``"import_module("``).
    """
    text, exc_type = str(error.get("text", "")), str(error.get("exc_type", ""))
    if error.get("kind") != "worker":
        return None
    if exc_type in IMPORT_ERRORS or marker in text:
        return f"{exc_type or 'the process died'}: {str(error.get('summary', ''))[:200]}"
    return None


#: ", expected <value>" up to a following " (N of M elements differ)" or the end of the line
EXPECTED_VALUE = re.compile(r", expected (?:(?! \(\d+ of )[^\n])*")


def redact_expected(message: str) -> str:
    """What a student may see: the wrong value, not the expected one (``EXPECTED_VALUE``)."""
    return EXPECTED_VALUE.sub(", which is wrong", message)
