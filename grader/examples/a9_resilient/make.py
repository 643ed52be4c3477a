"""Write example submissions of assignment 9, as an instructor would download them.

``python -m grader.examples.a9_resilient.make OUT`` writes, into OUT:

* ``alice``: correct (the solution): 60 (7.144 ms to the target on the measured run, the top tier:
  10.5 ms);
* ``lena``: the library's code copied -- the fault-tolerant step's ``exchange`` (its kill point
  dropped) and ``average_in_order``, word for word: right everywhere, 60; the similarity report
  flags it (a copy is reported to the instructor, not refused);
* ``tom``: delegating: the outer step takes ``torch.optim.SGD``'s step: refused at intake,
  ``forbidden``;
* ``dan``: deadlocks: ``exchange`` sends its gradient to every member with a blocking ``send``
  before it posts any receive: fine while a gradient fits a pipe's buffer, stuck on the 1.2 MB
  gradient (the elastic run is reported as a deadlock after 20 s): 50;
* ``ava``: wrong: averages over every member, a dead one's gradient counted as zeros -- the
  survivors claim a gradient they never received, the commit includes the dead slot: both quorum
  tests fail the replay: 38;
* ``fay``: wrong: ``flush`` drops the averages still in flight instead of applying them: the
  pending test fails: 54;
* ``gus``: a weaker design (DiLoCo with the paper's outer step, H = 10): 15.2 ms, the second tier
  (5 of 10): 55;
* ``forger`` (hostile): gus's design, and the class the transport keeps its counters in patched
  so that bytes and messages read 0 (reached through ``type(comm.stats)``, a name intake does not
  follow): the seal made before the submission was imported (``student_comm.CounterSeal``) sees
  the class changed, and every test that reads the counters fails ("tampered with"): the three
  streaming tests and the measured one, 30. (Had it been read, the
  score would still use max(counted, the design's floor): 12.216 ms, the same tier as gus.)

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` the status and score each must get on
all the hidden tests (``expected_score`` for a subset). The submissions are generated from
``solutions/`` and ``lib/`` (they follow both when they change); nothing here is committed but
this script.
"""

from __future__ import annotations

from pathlib import Path

from grader.a9_resilient.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a9_resilient" / "resilient.py"
FILE = "resilient.py"
LIBRARY = ROOT / "lib" / "minidist" / "parallel" / "elastic" / "step.py"

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))
_QUORUM = tuple(name for name in _ALL if name.startswith("test_quorum"))
_STREAMING = tuple(name for name in _ALL if name.startswith("test_streaming"))
MEASURED = "test_time_to_target[2-shm]"
LARGE = "test_quorum[3-large-mid-exchange]"
PENDING = "test_streaming[2-pending-flush]"

LOST = {
    "alice": ("ok", ()),
    "lena": ("ok", ()),
    "tom": ("forbidden", _ALL),
    "dan": ("ok", (LARGE,)),
    "ava": ("ok", _QUORUM),
    "fay": ("ok", (PENDING,)),
    "gus": ("ok", ()),
    "forger": ("ok", (*_STREAMING, MEASURED)),
}

#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"gus": {MEASURED: 0.5}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}

EXCHANGE_BEGIN = "    ### BEGIN SOLUTION TODO(task 3): every receive posted before the first send\n"
AVERAGE_BEGIN = "    ### BEGIN SOLUTION TODO(task 3): the one order every rank and the replay use\n"
END = "    ### END SOLUTION\n"
DESIGN = '"inner_steps": 50, "fragments": 1, "delay": 0, "mix": 0.0, "outer_lr": 1.4, "outer_momentum": 0.9'
WEAKER = '"inner_steps": 10, "fragments": 1, "delay": 0, "mix": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9'
PENDING_LINE = (
    "        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (apply after, fragment, average)\n"
)
FORGE = """        counts = type(comm.stats)  # the class the transport keeps its own counters in
        counts.bytes_sent = property(lambda anyone: 0, lambda anyone, value: None)
        counts.messages_sent = property(lambda anyone: 0, lambda anyone, value: None)
"""


def region(solution: str, begin: str, body: str) -> str:
    """``solution`` with the solution region that starts at ``begin`` holding ``body`` instead."""
    start = solution.index(begin) + len(begin)
    end = solution.index(END, start)
    return solution[:start] + body + solution[end:]


def library_body(name: str) -> str:
    """The body of ``name`` in the library's step.py (its docstring and kill point dropped)."""
    library = LIBRARY.read_text()
    start = library.index(f"def {name}(")
    start = library.index('"""', library.index('"""', start) + 3) + 4
    end = library.index("\n\n\n", start)
    lines = library[start:end].splitlines(keepends=True)
    kept, skip = [], False
    for line in lines:
        if "on_point" in line:  # the kill point and its guard: not in the student's signature
            skip = line.rstrip().endswith(":")
            continue
        if skip and line.startswith(" " * 20):
            continue
        skip = False
        kept.append(line)
    return "".join(kept) + "\n"


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    gus = edit(solution, DESIGN, WEAKER)
    lena = region(solution, EXCHANGE_BEGIN, library_body("exchange"))
    lena = region(lena, AVERAGE_BEGIN, library_body("average_in_order"))
    sources = {
        "alice": solution,
        "lena": lena,
        "tom": edit(
            solution,
            "    params.sub_(lr * (delta + mu * momentum))\n",
            "    params.grad = delta + mu * momentum  # torch's SGD takes the step\n"
            "    torch.optim.SGD([params], lr=lr).step()\n",
        ),
        "dan": edit(
            edit(
                solution,
                "    receives = {}\n",
                "    receives = {}\n    for peer in others:  # mine out first, then theirs in\n"
                "        try:\n            comm.send(flat, peer, tag=step + 1)\n"
                "        except PeerError:\n            pass\n",
            ),
            "            sends.append(comm.isend(flat, peer, tag=step + 1))\n",
            "            continue\n",
        ),
        "ava": edit(
            solution,
            "    return held\n    ### END SOLUTION\n",
            "    for peer in others:  # every member counts: a dead one as zeros\n"
            "        held.setdefault(peer, torch.zeros_like(flat))\n    return held\n    ### END SOLUTION\n",
        ),
        "fay": edit(
            solution,
            "        for item in list(self.pending):\n            self._apply(item)\n",
            "        self.pending.clear()  # nothing more to wait for\n",
        ),
        "gus": gus,
        "forger": edit(gus, PENDING_LINE, PENDING_LINE + FORGE),
    }
    return {name: {FILE: text.encode()} for name, text in sources.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()
