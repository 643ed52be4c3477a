"""Write example submissions of assignment 5, as an instructor would download them.

``python -m grader.examples.a5_model_parallel.make OUT`` writes, into OUT (each a folder with
``tp_layers.py`` and ``schedule.py``):

* ``alice``: correct (the solution);
* ``bob``: ``one_f_one_b`` returns GPipe (all forwards, then all backwards): a valid schedule
  with the same bubble, but it holds all m microbatches on every stage -- loses the exact 1F1B
  test and the in-flight peak; keeps the checker, the bubble and everything else;
* ``carol``: allreduces twice: her f also averages x over the ranks in the forward (an allreduce
  divided by p, "to be sure the ranks agree"). Where x is the same on every rank (the layers, the
  MLP) the values are right; she loses the conjugate-operator tests (rank-dependent x, and f's
  forward must not communicate) and the exact allreduce counts of the MLP;
* ``dave``: the row-parallel bias is added on every rank before the reduction (p times): loses
  the row-parallel tests with a bias and the MLP's equality with the dense one; keeps the counts;
* ``erin``: crashes: the last stage forgets to keep its loss for the backward (a KeyError at its
  first backward): every test of ``run_stage`` fails, the rest keeps its points;
* ``frank``: hands the layers to the library (``minidist.parallel.tensor``): refused at intake,
  status ``forbidden``;
* ``gina``: hangs: a stage never sends its activation forward, so stage r + 1 waits for it while
  stage r waits for a gradient (a deadlock: no rank returns): every test of ``run_stage`` runs
  into its timeout; the rest keeps its points;
* ``hank``: a column-parallel layer without f (``F.linear(x, ...)`` on x itself): the forward is
  right, but each rank's input gradient is only its own shard's part -- loses the column-parallel
  tests, the MLP's equality and the MLP's backward allreduce count; keeps the schedule and the
  stage step.

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

with warnings.catch_warnings():  # `points` is registered by grader/a5_model_parallel/conftest.py only
    warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
    from grader.a5_model_parallel import grading

ROOT = Path(__file__).resolve().parents[3]
FOLDER, STUB_FOLDER = ROOT / "solutions" / "a5_model_parallel", ROOT / "assignments" / "a5_model_parallel"
FILES = grading.STUDENT_FILES  # ("tp_layers.py", "schedule.py")

_ALL = tuple(t.name for t in grading.graded_tests(0))


def _named(*prefixes: str) -> tuple[str, ...]:
    return tuple(name for name in _ALL if name.startswith(prefixes))


_RUN_STAGE = _named("test_run_stage[")

#: student -> (status, the hidden tests it loses)
LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", ("test_one_f_one_b_exact", "test_schedule_peak_in_flight")),
    "carol": ("ok", _named("test_conjugate_operators[", "test_mlp_allreduce_count[")),
    "dave": (
        "ok",
        (
            "test_row_parallel[row-2]",
            "test_row_parallel[row-4-scatter]",
            *_named("test_parallel_mlp_equals_dense["),
        ),
    ),
    "erin": ("ok", _RUN_STAGE),
    "frank": ("forbidden", _ALL),
    "gina": ("ok", _RUN_STAGE),
    "hank": (
        "ok",
        _named("test_column_parallel[", "test_parallel_mlp_equals_dense[", "test_mlp_allreduce_count["),
    ),
}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in grading.graded_tests(0)}
    tests = list(points) if tests is None else tests
    return sum(points[name] for name in tests if name not in LOST[student][1])


#: student -> (status, score on every hidden test)
EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}


def edit(source: str, old: str, new: str) -> str:
    """``source`` with ``old`` (which must occur exactly once) replaced by ``new``."""
    if source.count(old) != 1:
        raise ValueError(f"the solution changed: {old!r} occurs {source.count(old)} times")
    return source.replace(old, new)


def replace_region(source: str, begin: str, body: str) -> str:
    """``source`` with the solution region that starts at the line ``begin`` holding ``body``."""
    start = source.index(begin) + len(begin)
    indent = begin[: len(begin) - len(begin.lstrip())]
    end = source.index(f"{indent}### END SOLUTION\n", start)
    return source[:start] + body + source[end:]


GPIPE_BODY = "    return gpipe(stages, microbatches)  # all forwards, then all backwards: simpler\n"

#: carol's f: "make sure the ranks agree" -- an allreduce in the forward too
AVERAGING_F = """        ctx.comm = comm
        return md.allreduce(comm, x.clone()) / comm.world_size
"""

FRANK_IMPORT = "from minidist.parallel import tensor as library\n"


def build_dict() -> dict[str, dict[str, bytes]]:
    layers, schedule = (FOLDER / "tp_layers.py").read_text(), (FOLDER / "schedule.py").read_text()
    bob = replace_region(schedule, "    ### BEGIN SOLUTION TODO(task 6): write one_f_one_b\n", GPIPE_BODY)
    carol = replace_region(
        layers, "        ### BEGIN SOLUTION TODO(task 1): write CopyToTensorParallel.forward\n", AVERAGING_F
    )
    dave = edit(
        layers,
        "        out = reduce_from_tensor_parallel(F.linear(x, self.weight), self.comm)\n"
        "        return out + self.bias if self.bias is not None else out\n",
        "        return reduce_from_tensor_parallel(F.linear(x, self.weight, self.bias), self.comm)\n",
    )
    erin = edit(schedule, "                kept[j] = (x, loss)\n", "")
    gina = edit(
        schedule,
        "                comm.send(out.detach().contiguous(), dst=rank + 1)\n",
        "                pass  # the activation goes with the backward (it never gets there)\n",
    )
    frank = edit(layers, "import minidist as md\n", "import minidist as md\n" + FRANK_IMPORT)
    frank = edit(
        frank,
        "class ColumnParallelLinear(nn.Module):",
        "ColumnParallelLinear = library.ColumnParallelLinear\n\n\nclass _MyColumnParallelLinear(nn.Module):",
    )
    hank = edit(
        layers,
        "        out = F.linear(copy_to_tensor_parallel(x, self.comm), self.weight, self.bias)\n",
        "        out = F.linear(x, self.weight, self.bias)\n",
    )
    both = {
        "alice": (layers, schedule),
        "bob": (layers, bob),
        "carol": (carol, schedule),
        "dave": (dave, schedule),
        "erin": (layers, erin),
        "frank": (frank, schedule),
        "gina": (layers, gina),
        "hank": (hank, schedule),
    }
    assert list(both) == list(LOST)
    return {name: {FILES[0]: tp.encode(), FILES[1]: sc.encode()} for name, (tp, sc) in both.items()}


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
