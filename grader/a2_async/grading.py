"""How ``python -m grader grade`` runs assignment 2: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its
ranks and JSON arguments, with data seeds only this run knows) that the sandbox runs, and the
case's check, which runs here on the reports read back as JSON and ``.npy``: the references
(``reference.py``) are recomputed here from the same seeds. The sandbox gets ``workers.py``
only: never ``cases.py``, ``reference.py``, the expected values or the points.
"""

from __future__ import annotations

import re

from grader.assignment import Assignment

_EXPECTED_VALUE = re.compile(r"(is [^,(]+), expected [^(]+?( \(|$)")


def redact(message: str) -> str:
    """What a student may see: the wrong value, not the expected one."""
    return _EXPECTED_VALUE.sub(r"\1, which is wrong\2", message)


#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = (
    "lib/minidist/glove/trainers/param_server/*.py",
    "lib/minidist/glove/trainers/hogwild.py",
)
#: functions the stub gives (every submission has them): not compared
GIVEN_FUNCTIONS = ("read_request",)

HINTS = {
    "staleness_aware_lr": "What rate do staleness 0 and staleness 1 get, by the docstring's examples?",
    "run_server": "Which two messages answer a pull, in which order? When does the version move?",
    "ps_worker": "Which version does a push carry? Do the rows and gradients of a push line up? DONE?",
    "hogwild_worker": "Which part of the pairs is this rank's (module docstring), and in which order?",
    "prefetching_worker": "Is push k computed from pull k's answer? Which pull can leave earlier?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=GIVEN_FUNCTIONS,
    timeout=30,
    student_code="async_ps.py",
    deadlock_hint=(
        "A worker waiting for an answer the server never sends, or a server waiting for a DONE that"
        " never comes?"
    ),
    import_marker="import_module(STUDENT_MODULE)",
    redact=redact,
)
