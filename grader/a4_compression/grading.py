"""How ``python -m grader grade`` runs assignment 4: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the second DGC
(``reference.py``) is recomputed here from the same arguments. The sandbox gets ``workers.py``
and ``rules.py`` only: never ``test_hidden.py``, ``reference.py``, the expected values or the
points.
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
SIMILAR_TO = ("lib/minidist/parallel/compression/*.py",)
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = (
    "DGCConfig.__post_init__",
    "DGCState.zeros_like",
    "slots_for",
    "pack",
    "unpack",
    "SparseWork.__init__",
)
WORKERS_MODULE = "workers"

HINTS = {
    "sparsity_at": "stage = step // warmup_stage_steps; past the stages (or no warm-up): config.sparsity.",
    "clip_local": "threshold = clip_norm / sqrt(world_size); scale by threshold / norm only if the "
    "norm is larger.",
    "select_indices": "Follow the docstring's recipe line by line: one randint draw of s positions, the "
    "ks-th largest sample, >=, a stable descending sort when more than k.",
    "compress_step": "u = m u + g; v += u; select on v; send v[S]; then zero v[S] and u[S] (keep the rest!).",
    "DGCHook.__call__": "k from the step before compress_step; pack; ONE md.allgather(..., async_op=True); "
    "SparseWork.wait: add the rows in rank order, divide by N.",
}


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    return graded_tests_from_cases(hidden.cases(seed), WORKERS_MODULE)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    return ranked_failure_message(hidden, test, error, seconds)


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because ``dgc.py`` could not be imported."""
    return import_failure_of(error, "import_module(STUDENT_MODULE)")


#: what a student may see: the wrong value, not the expected one
redact = redact_expected
