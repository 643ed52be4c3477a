"""How ``python -m grader grade`` runs assignment 8: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its ranks
and JSON spec, with seeds only this run knows) that the sandbox runs, and the case's check,
which runs here on the reports: the transposes, the router counted choice by choice, the mixture
token by token, the transport's bytes (``reference.py``). The sandbox gets ``workers.py`` and
``rules.py`` only.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = (
    "lib/minidist/collectives/all_to_all.py",
    "lib/minidist/parallel/experts/*.py",
)

HINTS = {
    "all_to_all": "In step s of a pairwise exchange, whom does rank r send to and receive from, and is "
    "each receive matched by a send the peer posts in the same step? What does a blocking send of a large "
    "message do on pipes? Which bytes did you send that the contract does not list?",
    "route": "Which order is the priority order of a (T, k) table of choices (by position: token, then "
    "choice), and does your running count of each expert's queue follow it? Is the gate of k > 1 "
    "renormalised over the k choices only?",
    "dispatch": "Which (expert, slot) does choice (t, j) occupy, and what do the slots no choice occupies "
    "hold? Is every result built from its inputs with operations autograd follows?",
    "ExpertParallelMoE": "What is the backward of your all_to_all, and does every rank run its backward "
    "exchanges in the same order? Which gradient does an expert on another rank need back? For the "
    "measured test: which rows does your layout send that no expert needs, and how often does one token "
    "travel to the same rank (lecture 10 section 3)?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=("capacity",),
    timeout=60,
    student_code="experts.py",
    deadlock_hint=(
        "Every receive needs a matching send: does any rank wait for a peer that waits too -- for "
        "example a blocking send of a large message that its receiver has not posted a receive for?"
    ),
)
