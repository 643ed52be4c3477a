"""What the grader runs for one hidden test: a ``Job`` in the sandbox, a trusted check here.

An assignment (``grader/assignment.py``, declared in ``grader/<name>/grading.py``) turns each
case of its table into a ``GradedTest``: the ``Job`` says which worker of the assignment's
``workers.py`` to launch, on how many ranks, with which JSON arguments; the ``check`` runs in
the grader on the reports read back. ``TestResult`` is what the gradebook records of it.

The split is the trust boundary: a ``Job`` runs with the student's code, in the sandbox; a
``check`` runs in the grader, never next to student code, on data read back in a format that
cannot execute code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grader.tiers import Tiers


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
    """One hidden test: ``check(outs)`` raises (pytest.fail, AssertionError, ...) when it fails.

    A measured test (``tiers`` given) returns the measured value when the result is right; the
    value earns a fraction of ``points`` by ``tiers`` (``grader/tiers.py``)."""

    name: str
    points: float
    function: str  # the student function it exercises (for hints and the summary)
    job: Job
    check: Callable[[list], Any]
    tiers: Tiers | None = None


@dataclass
class TestResult:
    name: str
    points: float
    max_points: float
    passed: bool
    function: str
    message: str = ""  # why it failed, already redacted; for a measured test, what it measured
    seconds: float = 0.0
    measured: float | None = None  # a measured test's value (None: not one, or the result was wrong)
    quantity: str = ""  # what it measures (the leaderboard's column)
    order: str = ""  # "asc" when lower is better (Gradescope's leaderboard order)
