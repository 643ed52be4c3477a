"""The case table of assignment 3 (bucketed DDP that overlaps backward). Instructors only.

Every test is a ``Case`` of ``cases(seed)``: a job (a worker of ``workers.py``, a number of
ranks, JSON arguments) and a trusted check of what the ranks report (``reference.py``). pytest
runs them with seed 0; ``grading.py`` runs the same cases with a seed per student (other
weights, other data, other parameter shapes for task 1). The models are ones the public tests
do not have: an MLP, the same with a frozen first layer and a LayerNorm, the same with a layer
it never calls, a tied-embedding language model, and that one with a frozen and an unused
layer; on 2 and 3 ranks, on the "shm" and "pipe" transports.

* ``assign_buckets`` against a second implementation of the rule (task 1);
* after 3 AdamW steps every rank's gradients (first step) and parameters equal one process
  training on the whole batch (tasks 2 and 3);
* exactly one allreduce per bucket per step, each carrying that bucket's gradient (a copy
  logged by the grader's wrapper of ``md.allreduce``, compared with the rank's local gradients
  recomputed on the trusted side), no other collective or point-to-point message, and the
  transport's own byte and message count equal to the allreduces' (task 2);
* overlap: every allreduce asynchronous, the buckets launched strictly in bucket order, each
  before the next gradient after the moment it and the buckets before it are complete (the last
  bucket: before backward ends) -- the order of events noted by the grader's own hooks, which
  run before the student's (task 2);
* the recorder gets one span per bucket, within backward (tasks 2 and 3);
* ``no_sync``: 3 micro-batches per step, the same as one process, no allreduce inside (task 2);
* measured, in tiers (task 4): ``tuned_bucket_mb`` picks the cap for a timed 12-block model
  (``workers.timed_layout``) on 2 ranks over a 1 Gbit/s link; the student's DDP trains it with
  that cap; the trusted side replays the step on the emulated clock from the grader's records
  (``reference.emulated_step``) and returns its time over max(compute, communication).

The tests of tasks 2-4 hold the communication to the student's own buckets (``ddp.buckets``)
when they are a partition of the trainable parameters within ``bucket_mb``: the bucket rule is
task 1's test alone. Overlap, spans and no_sync also require the communication of the count
test (``reference.communication``): what the ranks end with came from the buckets' allreduces.

The folder holding the student's ``ddp.py`` must be on PYTHONPATH; it is imported only in the
worker processes. Each ``Case`` carries its points; ``grading.py`` declares the assignment.
"""

from __future__ import annotations

import random

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref

TASKS = {
    "assign_buckets": 1,
    "_on_gradient_ready": 2,
    "_launch": 2,
    "no_sync": 2,
    "_finish_backward": 3,
    "tuned_bucket_mb": 4,
}
#: bucket sizes that cut each model into several buckets (double precision: 8 bytes an element)
BUCKET_MB = {
    "deep": 0.004,
    "frozen": 0.004,
    "unused": 0.004,
    "tied": 2048 / ref.MIB,
    "mixed": 2048 / ref.MIB,
    "timed": 1.0,  # the measured test: replaced by what tuned_bucket_mb returns
}
#: the measured test, graded in tiers: emulated step time over max(compute, communication)
STEP_TIME_TIERS = Tiers(
    quantity="emulated step time / max(compute, communication)",
    unit="x",
    levels=((1.05, 1.0), (1.25, 0.5), (1.5, 0.25)),
    lower_is_better=True,
    baseline="the library's DDP with its default cap (bucket_mb=1.0): 1.23x",
)


def spec(seed: int, base: int, model: str, ranks: int, **extra) -> dict:
    return {
        "model": model,
        "seed": (seed * 1000 + base) % 2**31,
        "ranks": ranks,
        "local_batch": 3,
        "steps": 3,
        "bucket_mb": BUCKET_MB[model],
        "find_unused": model in ("unused", "mixed"),
        "lr": 0.01,
        **extra,
    }


def bucket_cases(seed: int) -> list[dict]:
    """Parameter lists for ``assign_buckets``: fixed corner cases and seeded random ones."""
    kib = 1024 / ref.MIB
    cases = [
        # the docstring's example in float32: 400, 400, 300, 1200 bytes, cap 1000
        {
            "params": [
                ["a", [100], False, "float32"],
                ["b", [100], False, "float32"],
                ["c", [75], False, "float32"],
                ["d", [300], False, "float32"],
            ],
            "bucket_mb": 1000 / ref.MIB,
        },
        # a bucket that reaches the cap exactly is closed; a frozen one is skipped; a tied one
        # counted once
        {
            "params": [
                ["emb", [16, 8], False, "float32"],
                ["frozen", [64], True, "float32"],
                ["w", [8, 8], False, "float32"],
                ["b", [64], False, "float32"],
                ["head", "=", "emb"],
            ],
            "bucket_mb": 512 / ref.MIB,
        },
        # every parameter over the cap: one bucket each; float64 counts 8 bytes
        {
            "params": [["x", [40], False, "float64"], ["y", [50], False, "float64"]],
            "bucket_mb": 100 / ref.MIB,
        },
        # everything frozen: no bucket
        {"params": [["x", [4], True, "float32"]], "bucket_mb": 1.0},
        # another dtype closes the open bucket (a flat buffer has one); a zero cap: one each
        {
            "params": [
                ["a", [4], False, "float64"],
                ["b", [4], False, "float32"],
                ["c", [4], False, "float32"],
            ],
            "bucket_mb": 1.0,
        },
        {"params": [["a", [4], False, "float32"], ["b", [2], False, "float32"]], "bucket_mb": 0.0},
    ]
    rng = random.Random(seed)
    for _ in range(4):
        params = []
        for index in range(rng.randint(5, 12)):
            if params and rng.random() < 0.15:
                params.append([f"tied{index}", "=", rng.choice([p[0] for p in params if p[1] != "="])])
                continue
            shape = [rng.randint(1, 24) for _ in range(rng.randint(1, 2))]
            params.append([f"p{index}", shape, rng.random() < 0.2, rng.choice(["float32", "float64"])])
        cases.append({"params": params, "bucket_mb": rng.choice([0.5, 1, 2, 3]) * kib})
    return cases


# --- the cases ---------------------------------------------------------------------------------
def cases(seed: int) -> list[Case]:
    buckets = bucket_cases(seed)
    out = [
        Case(
            "test_assign_buckets",
            4,
            "assign_buckets",
            "bucket_cases",
            1,
            [buckets],
            ref.buckets_check("assign_buckets", buckets),
        )
    ]

    def train(name, points, function, s, transport, check):
        what = f"{s['model']} model on {s['ranks']} ranks, transport {transport!r}"
        s = {**s, "transport": transport}  # the trusted side's byte count depends on it
        out.append(Case(name, points, function, "train", s["ranks"], [s], check(what, s), transport))

    for base, (model, ranks, transport) in enumerate(
        [
            ("deep", 2, "shm"),
            ("tied", 3, "shm"),
            ("frozen", 2, "pipe"),
            ("unused", 3, "pipe"),
            ("mixed", 2, "shm"),
        ]
    ):
        s = spec(seed, 10 + base, model, ranks)
        name = f"test_matches_one_process[{model}-{ranks}-{transport}]"
        train(name, 3, "_finish_backward", s, transport, ref.equivalence_check)
    for base, (model, ranks, transport) in enumerate([("deep", 3, "shm"), ("mixed", 2, "pipe")]):
        s = spec(seed, 20 + base, model, ranks)
        name = f"test_one_allreduce_per_bucket[{model}-{ranks}-{transport}]"
        train(name, 3, "_on_gradient_ready", s, transport, ref.count_check)
    s = spec(seed, 30, "tied", 2)
    train("test_overlap[tied-2-shm]", 4, "_on_gradient_ready", s, "shm", ref.overlap_check)
    s = spec(seed, 31, "deep", 2)
    train("test_trace_spans[deep-2-shm]", 2, "_launch", s, "shm", ref.trace_check)
    for base, (model, ranks, transport) in enumerate([("deep", 2, "shm"), ("frozen", 3, "pipe")]):
        s = spec(seed, 40 + base, model, ranks, accumulate=3)
        name = f"test_no_sync_accumulates[{model}-{ranks}-{transport}]"
        train(name, 3, "no_sync", s, transport, ref.no_sync_check)
    # measured: the seed changes the data only; the model, the link and so the value are fixed
    s = {**spec(seed, 50, "timed", 2), "steps": 1, "transport": "shm"}
    what = "the timed model on 2 ranks over the emulated 1 Gbit/s link"
    out.append(
        Case(
            "test_step_time[timed-2-1gbit]",
            6,
            "tuned_bucket_mb",
            "tuned",
            2,
            [s],
            ref.step_time_check(what, s),
            "shm",
            tiers=STEP_TIME_TIERS,
        )
    )
    return out
