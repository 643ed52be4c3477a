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

from collections.abc import Callable
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
