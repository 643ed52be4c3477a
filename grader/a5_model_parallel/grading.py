"""How ``python -m grader grade`` runs assignment 4: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``test_hidden.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the dense model and
the schedules (``reference.py``) are recomputed here from the same arguments. The sandbox gets ``workers.py``
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
SIMILAR_TO = ("lib/minidist/parallel/tensor.py", "lib/minidist/parallel/pipeline.py")
#: functions the stub gives (every submission has them), and the canonical few-liners: not compared
GIVEN_FUNCTIONS = (
    "shard_range",
    "_GatherLastDim.forward",
    "_GatherLastDim.backward",
    "_ScatterLastDim.forward",
    "_ScatterLastDim.backward",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "_check_sizes",
    "gpipe",
) + (
    # not given, but not compared either: their docstrings dictate a few lines that every correct
    # answer writes alike (the library's versions, written from the same specification, are the
    # same tokens: 0.87-1.0 for the solution); a copy shows in the functions that are left
    "ColumnParallelLinear.forward",
    "RowParallelLinear.forward",
    "ParallelMLP.load_dense",
    "one_f_one_b",
)
WORKERS_MODULE = "workers"

HINTS = {
    "copy_to_tensor_parallel": "f: forward returns x.clone() (no communication); backward returns "
    "md.allreduce(ctx.comm, grad.clone()), None. g is the mirror image.",
    "reduce_from_tensor_parallel": "g: forward returns md.allreduce(comm, x.clone()); "
    "backward returns grad, None.",
    "ColumnParallelLinear": "Rank r keeps rows [r d_out/p, (r+1) d_out/p) of W and b; forward: "
    "F.linear(f(x), W_r, b_r), gathered only if gather_output.",
    "RowParallelLinear": "Rank r keeps columns [r d_in/p, (r+1) d_in/p) of W and the whole bias; forward: "
    "g(F.linear(x_r, W_r)) + b -- the bias after the sum, once.",
    "ParallelMLP": "up: ColumnParallelLinear(d, ffn) without gather; exact F.gelu; "
    "down: RowParallelLinear(ffn, d) "
    "with a parallel input. No other allreduce: one forward (g), one backward (f).",
    "one_f_one_b": "Stage r: w = min(p - 1 - r, m) forwards; then m - w pairs (F w+i, B i); then the last w "
    "backwards. It holds at most p - r microbatches (GPipe holds m).",
    "run_stage": "F: input (inputs[j] or recv from r-1, requires_grad_), out = stage(x), send to r+1 or "
    "the loss; B: (loss/m).backward() or recv the gradient from r+1 and out.backward(grad); "
    "send x.grad to r-1. One message per microbatch and direction; count what is kept.",
}


def graded_tests(seed: int) -> list[GradedTest]:
    """Every hidden test of ``test_hidden.py``, in its order, as (job, trusted check)."""
    return graded_tests_from_cases(hidden.cases(seed), WORKERS_MODULE)


def failure_message(test: GradedTest, error: dict, seconds: float) -> str:
    """The student-facing message for a job that did not return (``error`` as the harness wrote it)."""
    return ranked_failure_message(hidden, test, error, seconds)


def import_failure(error: dict) -> str | None:
    """A one-line summary when a job failed because a student module could not be imported."""
    return import_failure_of(error, "import_module(name)")


#: what a student may see: the wrong value, not the expected one
redact = redact_expected
