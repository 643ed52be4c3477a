"""How ``python -m grader grade`` runs assignment 7: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its ranks
and JSON spec, with seeds only this run knows) that the sandbox runs, and the case's check,
which runs here on the reports: the one-process training, the shard layout, the counts and the
measured peak (``reference.py``). The sandbox gets ``workers.py`` and ``rules.py`` only.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = (
    "lib/minidist/parallel/zero/optimizer.py",
    "lib/minidist/parallel/zero/fully_sharded.py",
)

HINTS = {
    "ShardedAdamW": "Which flat positions does your rank own once the vector is padded to a multiple of N, "
    "and what does reduce_scatter expect as its input's shape? Is your gradient the average, and is AdamW's "
    "state only your shard's?",
    "ShardedStack": "When does a unit's backward begin, who gathers its weights again then, and what did "
    "autograd save that still points at the weights you freed? Which bytes of your step live longer "
    "than they must (lecture 8 section 3)?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    sandbox_preload=("torch._dynamo",),  # its workers build torch.optim optimizers
    hints=HINTS,
    similar_to=SIMILAR_TO,
    timeout=60,
    student_code="zero.py",
    deadlock_hint=(
        "Every rank must issue the same collectives in the same order: does every rank gather "
        "and reduce-scatter every unit, also one whose gradient did not arrive?"
    ),
    import_marker="import_module(STUDENT_MODULE)",
)
