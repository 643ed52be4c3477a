"""How ``python -m grader grade`` runs assignment 4: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with seeds only this run knows) that the sandbox runs, and the case's
check, which runs here on the reports read back as JSON and ``.npy``: the second DGC
(``reference.py``) is recomputed here from the same arguments. The sandbox gets ``workers.py``
and ``rules.py`` only: never ``cases.py``, ``reference.py``, the expected values or the
points.
"""

from __future__ import annotations

from grader.assignment import Assignment

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

HINTS = {
    "sparsity_at": "Which stage is the step in, and what comes after the last stage (or without warm-up)?",
    "clip_local": "Each rank clips its own, un-averaged gradient at clip_norm * sqrt(world_size) (the paper "
    "clips grad / N at clip_norm / sqrt(N)); is a gradient that is short enough returned as a copy?",
    "select_indices": "Check the docstring's contract point by point: ONE randint draw of s positions, the "
    "ceil(s k / n)-th largest sample, >= the threshold, equal magnitudes to the smaller index.",
    "compress_step": "Check the contract's order: clip, u = m u + g, v += u, select on v, send v there; "
    "then only the sent entries of v and u become 0.",
    "DGCHook.__call__": "Which step's k does the payload need, given that compress_step advances the "
    "step? ONE md.allgather(..., async_op=True); SparseWork.wait adds the rows in rank order, divides by N.",
    "measured_hook": "Return a new hook; each step one asynchronous allgather of pack's int32 payload per "
    "bucket, and wait() the mean of the payloads. Fewer slots per step, or fewer steps?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    sandbox_preload=("torch._dynamo",),  # its workers build torch.optim optimizers
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=60,
    student_code="dgc.py",
    deadlock_hint="Every rank must launch one allgather per bucket, of the same size (k slots, padded).",
    import_marker="import_module(STUDENT_MODULE)",
)
