"""How ``python -m grader grade`` runs assignment 9: the hidden tests as jobs plus trusted checks.

Each ``Case`` of ``cases.cases(seed)`` becomes a ``Job`` (a worker of ``workers.py``, its ranks
and JSON spec, with seeds only this run knows) that the sandbox runs, and the case's check, which
runs here on the reports: the outer step and the schedule from their formulas, Streaming DiLoCo
simulated in one process, the elastic runs replayed (``reference.py``). The sandbox gets
``workers.py`` and ``rules.py`` only.
"""

from __future__ import annotations

from grader.assignment import Assignment

#: the library files a submission is compared with (``grader/similarity.py``), relative to the root
SIMILAR_TO = (
    "lib/minidist/parallel/local_sgd/*.py",
    "lib/minidist/parallel/elastic/step.py",
)

HINTS = {
    "nesterov_step_": "Which comes first, the momentum update or the parameter step, and which buffer "
    "value does the Nesterov look-ahead use (torch.optim.SGD's convention, dampening 0)?",
    "fragments_due": "offset_f = (f + 1) H // F; is step t counted from 1, and is fragment f launched "
    "again every H steps after its offset?",
    "StreamingSync": "At which step is a fragment launched, and when is its average applied (tau steps "
    "later: before or after that step's launches)? Is the pseudo-gradient the global slice minus the "
    "local one at launch time? What does flush() do with the averages still in flight?",
    "exchange": "Is every receive posted before the first send (a blocking send of a gradient over a "
    "pipe's 1 MiB buffer waits for a reader)? Do you survive a dead member's PeerError, and do you "
    "keep a gradient you never received?",
    "average": "Are the contributors' gradients added in slot order, left to right, and divided by "
    "their number -- the same bits on every survivor and in a one-process replay?",
}

ASSIGNMENT = Assignment.of(
    __package__,
    hints=HINTS,
    similar_to=SIMILAR_TO,
    given_functions=("fragment_bounds", "StreamingSync._flat", "StreamingSync._write"),  # the stub gives them
    timeout=60,
    student_code="resilient.py",
    deadlock_hint=(
        "A deadlock? Every receive needs a matching send: does any rank wait for a peer that waits "
        "too -- for example a blocking send of a gradient larger than a pipe's buffer that its "
        "receiver has not posted a receive for?"
    ),
)
