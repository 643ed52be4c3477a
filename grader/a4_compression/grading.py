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
    "sparsity_at": "stage = step // warmup_stage_steps; past the stages (or no warm-up): config.sparsity.",
    "clip_local": "each rank clips its own gradient at clip_norm * sqrt(world_size) (the paper: grad / N at "
    "clip_norm / sqrt(N)); scale by threshold / norm only if the norm is larger.",
    "select_indices": "Follow the docstring's recipe line by line: one randint draw of s positions, the "
    "ks-th largest sample, >=, a stable descending sort when more than k.",
    "compress_step": "u = m u + g; v += u; select on v; send v[S]; then zero v[S] and u[S] (keep the rest!).",
    "DGCHook.__call__": "k from the step before compress_step; pack; ONE md.allgather(..., async_op=True); "
    "SparseWork.wait: add the rows in rank order, divide by N.",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=60,
    student_code="dgc.py",
    deadlock_hint="Every rank must launch one allgather per bucket, of the same size (k slots, padded).",
    import_marker="import_module(STUDENT_MODULE)",
)
