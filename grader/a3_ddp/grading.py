"""How ``python -m grader grade`` runs assignment 3: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the one-process training
and the buckets it must match (``reference.py``) are recomputed here from the same spec. The
sandbox gets ``workers.py`` and ``rules.py`` only: never ``cases.py``, ``reference.py``,
the expected values or the points.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = (
    "lib/minidist/parallel/ddp.py",
    "lib/minidist/parallel/ddp_naive.py",
    "lib/minidist/parallel/autograd_graph.py",
    "lib/minidist/parallel/buckets.py",
)
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

HINTS = {
    "assign_buckets": "Trainable parameters once each, reversed; close a bucket before it goes over.",
    "_on_gradient_ready": "Copy param.grad into its slot; a bucket's last gradient launches its allreduce.",
    "_launch": "recorder.begin(...) at the launch, recorder.end(token) when wait() returns.",
    "_finish_backward": "Launch what is left (unused: zeros); wait in order, divide by p, copy back.",
    "no_sync": "A flag the hook reads; restore it in a finally block.",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=30,
    student_code="ddp.py",
    deadlock_hint=(
        "A bucket whose parameters got no gradient is never complete: with "
        "find_unused_parameters=True, launch it when backward ends."
    ),
    import_marker="import_module(STUDENT_MODULE)",
)
