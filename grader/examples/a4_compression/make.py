"""Write example submissions of assignment 4, as an instructor would download them.

``python -m grader.examples.a4_compression.make OUT`` writes, into OUT:

* ``alice``: correct (the solution);
* ``bob``: no error feedback: after sending, the whole accumulation is dropped (``v = 0``), not
  only the entries sent -- loses the sequences, the error-feedback test, the hook's values and
  convergence; keeps the schedule, clipping, the selection and the bytes;
* ``carol``: an exact top-k (a stable sort of all n magnitudes) instead of the sampled
  threshold. Honest and often better, but not the algorithm asked for, and the grader compares
  indices exactly: she loses the two tests where the sample is smaller than the bucket (the
  sampled selection and the sampled sequence) and keeps everything else -- where the sample is
  every entry the recipe *is* the exact top-k (ties to the smaller index), her bytes are the
  same k slots, and her run converges;
* ``dave``: no momentum correction: accumulates the raw gradient (``v += g``) instead of the
  velocity -- loses both sequences, the hook's values and convergence (plain SGD underneath);
  keeps the error-feedback test (it runs with momentum 0, where the two are the same);
* ``erin``: crashes: the hook looks its bucket's state up before making it (a KeyError in the
  first hook call): every test of the hook fails, tasks 1-4 keep their points;
* ``frank``: hands the selection to the library's ``select_indices``
  (``minidist.parallel.compression``): refused at intake, status ``forbidden``.

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` holds the status and score each
must get on all the hidden tests (``expected_score`` for a subset). The submissions are generated
from ``solutions/`` (so they follow the assignment when it changes); nothing here is committed
but this script.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest

from grader.examples.a1_collectives.make import write

with warnings.catch_warnings():  # `points` is registered by grader/a4_compression/conftest.py only
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    from grader.a4_compression import grading

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a4_compression" / "dgc.py"
STUB = ROOT / "assignments" / "a4_compression" / "dgc.py"
FILE = "dgc.py"

_ALL = tuple(t.name for t in grading.graded_tests(0))
_HOOK = tuple(name for name in _ALL if name.startswith(("test_hook", "test_bytes", "test_converges")))
_SEQUENCES = ("test_compress_sequence[whole]", "test_compress_sequence[sampled]")
_VALUES = (*_SEQUENCES, "test_hook_matches_simulation[2-pipe]", "test_converges[2-shm]")
#: student -> (status, the hidden tests it loses)
LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", (*_VALUES, "test_error_feedback_loses_nothing")),
    "carol": ("ok", ("test_select_sampled_threshold", "test_compress_sequence[sampled]")),
    "dave": ("ok", _VALUES),
    "erin": ("ok", _HOOK),
    "frank": ("forbidden", _ALL),
}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in grading.graded_tests(0)}
    tests = list(points) if tests is None else tests
    return sum(points[name] for name in tests if name not in LOST[student][1])


#: student -> (status, score on every hidden test)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}

EXACT_TOP_K = """    n = values.numel()
    if k >= n:
        return torch.arange(n)
    order = torch.sort(values.abs(), descending=True, stable=True).indices  # exact: sort all n
    return order[:k].sort().values
    ### END SOLUTION
"""


def edit(source: str, old: str, new: str) -> str:
    """``source`` with ``old`` (which must occur exactly once) replaced by ``new``."""
    if source.count(old) != 1:
        raise ValueError(f"the solution changed: {old!r} occurs {source.count(old)} times")
    return source.replace(old, new)


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    bob = edit(
        solution,
        "    v.index_fill_(0, keep, 0.0)  # error feedback: only what was sent leaves v\n",
        "    v.zero_()  # start afresh every step\n",
    )
    select_start = "    ### BEGIN SOLUTION TODO(task 3): write select_indices\n"
    begin = solution.index(select_start) + len(select_start)
    end = solution.index("    ### END SOLUTION\n", begin) + len("    ### END SOLUTION\n")
    carol = solution[:begin] + EXACT_TOP_K + solution[end:]
    dave = edit(
        solution,
        "    v.add_(u)  # ...is what accumulates\n",
        "    v.add_(grad)  # the gradient accumulates\n",
    )
    erin = edit(
        solution,
        "        if bucket_index not in self.states:\n"
        "            self.states[bucket_index] = DGCState.zeros_like(flat_grad)\n",
        "",
    )
    frank = edit(
        solution,
        "import minidist as md",
        "from minidist.parallel.compression import dgc as library\n\nimport minidist as md",
    )
    frank = edit(
        frank,
        select_start,
        select_start
        + "    return library.select_indices(values, k, config.sample_ratio, generator, config.min_sample)\n",
    )
    texts = (solution, bob, carol, dave, erin, frank)
    return {name: {FILE: text.encode()} for name, text in zip(LOST, texts)}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    written = build(args.out)
    print(f"wrote {len(written)} submissions into {args.out}")


if __name__ == "__main__":
    main()
