"""How ``python -m grader grade`` runs assignment 1: the hidden tests as jobs plus trusted checks.

The grader runs the hidden tests so that nothing the student's code does can pass one:

* each case of ``cases.py`` becomes a ``Job`` -- which worker of ``workers.py`` to launch, on how
  many ranks, with which inputs (seeds the grader chose for this student) -- that the sandbox
  runs, writing the raw reports back as JSON and ``.npy`` files;
* the case's check runs here, in the grader's own process, on those reports: the expected values
  come from ``reference.py``'s single-process references, recomputed from the seeds. The
  sandbox never sees ``cases.py``, ``reference.py``, the expected values or the points.

The names and points are the case table's, so the gradebook reads like the pytest report an
instructor knows (``test_hidden.py`` is generated from the same table).
"""

from __future__ import annotations

import re

from grader.assignment import Assignment

SIMILAR_TO = ("lib/minidist/collectives/*.py",)
GIVEN_FUNCTIONS = ("chunk_offsets", "exchange")

HINTS = {
    "tree_broadcast": "Counted from the source, which ranks hold the data in round k? Whom do they send to?",
    "ring_allgather": "Which input does rank r pass on at step s, so that it already holds it?",
    "ring_reduce_scatter": "Is dim 0 checked before any message? Where does a received partial sum go?",
    "ring_allreduce": "Chunks of unequal or zero size? A non-contiguous input? Which chunk at which step?",
    "butterfly_allreduce": "Which ranks fold in and out when p is not a power of two? Who is whose partner?",
    "fast_allreduce": "Which algorithm is fastest at this size on the link model, and do all ranks agree?",
}

_EXPECTED_VALUE = re.compile(r"(element \([^)]*\) is [^,]+), expected [^(]+\(")


def redact(message: str) -> str:
    """What a student may see: the wrong element and its value, not the expected value."""
    return _EXPECTED_VALUE.sub(r"\1, which is wrong (", message)


ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=30,
    student_code="collectives.py",
    deadlock_hint="A deadlock? Every send needs the matching recv on its peer, in the same order.",
    import_marker='import_module("collectives")',
    redact=redact,
)
