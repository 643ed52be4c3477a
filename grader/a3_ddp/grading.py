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
    "BucketedDDP._end_span",
)

HINTS = {
    "assign_buckets": "When is a bucket closed: before it would pass the cap, or once it holds at least "
    "the cap? And what else closes it?",
    "_on_gradient_ready": "Which buckets may leave when this gradient completes one, if an earlier bucket is "
    "still waiting? What does a backward inside no_sync send?",
    "_launch": "When does your span end: when someone waits, or when the allreduce completes? Who tells you?",
    "_finish_backward": "Which buckets can still be unlaunched when backward ends, in which order may they "
    "go, and what must be reset, also when you raise?",
    "no_sync": "What does your hook read to know it is inside no_sync, and what if the body raises?",
    "tuned_bucket_mb": "Can you predict a step's emulated time for a given cap, as lecture 5 section 4 does, "
    "and then choose among caps?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    sandbox_preload=("torch._dynamo",),  # its workers build torch.optim optimizers
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
