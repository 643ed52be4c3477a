"""Write example submissions of assignment 2, as an instructor would download them.

``python -m grader.examples.a2_async.make OUT`` writes, into OUT:

* ``alice``: correct (the solution);
* ``bob``: partially correct: a server that ignores the staleness (always ``config.lr``), and
  no Hogwild (the stub's ``hogwild_worker``);
* ``carol``: wrong everywhere: ``staleness_aware_lr`` multiplies, the server never counts
  versions, the workers push version 0, and every Hogwild rank trains on all the pairs;
* ``dave``: workers that never say DONE: the server waits for them forever (a deadlock in
  every test with its workers; its server still earns its points with the trusted workers);
* ``erin``: imports a module that does not exist;
* ``library_trainer``: its ``hogwild_worker`` calls the library's Hogwild worker
  (``minidist.glove.trainers.hogwild``): refused at intake, status ``forbidden``;
* ``hidden_trainer``: the same through another module that imports the trainers
  (``minidist.bench.glove``), which the intake check cannot resolve: the run time guard
  refuses the call, status ``forbidden``;
* ``library_worker``: correct, but its ``prefetching_worker`` is the library's worker
  (``ps_worker``: pull, wait, compute, push): 1.86x the lower bound on the measured test
  (``test_prefetching_worker_time``), its third tier, 1.5 of its 6 points.

The others' ``prefetching_worker`` is the solution's (bob, carol and dave break other functions).

``EXPECTED`` holds the status and score each must get on all the hidden tests. The
submissions are generated from ``solutions/`` and ``assignments/`` (so they follow the
assignment when it changes); nothing here is committed but this script.
"""

from __future__ import annotations

from pathlib import Path

from grader.examples import common
from grader.examples.a1_collectives.make import function_source, replace_function
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a2_async" / "async_ps.py"
STUB = ROOT / "assignments" / "a2_async" / "async_ps.py"
FILE = "async_ps.py"

#: student -> (status, score on every hidden test, out of 44)
EXPECTED = {
    "alice": ("ok", 44),
    "bob": ("ok", 33),
    "carol": ("ok", 19),
    "dave": ("ok", 30),
    "erin": ("import_error", 0),
    "library_trainer": ("forbidden", 0),
    "hidden_trainer": ("forbidden", 0),
    "library_worker": ("ok", 39.5),
}

LIBRARY_HOGWILD = """
def hogwild_worker(comm, order, table, gradsq, config):
    history, _ = library_hogwild(comm, order, table, gradsq, config, False)
    return [loss for _, loss in history]
"""
HIDDEN_HOGWILD = """
def hogwild_worker(comm, order, table, gradsq, config):
    # the trainers, as imported by the benchmark: the intake check cannot resolve the name
    history, _ = bench_glove.t.hogwild.hogwild_worker(comm, order, table, gradsq, config, False)
    return [loss for _, loss in history]
"""


def build_dict() -> dict[str, dict[str, bytes]]:
    solution, stub = SOLUTION.read_text(), STUB.read_text()
    bob = edit(solution, "staleness_aware_lr(config.lr, version - pulled)", "config.lr")
    bob = replace_function(bob, "hogwild_worker", function_source(stub, "hogwild_worker"))
    carol = edit(solution, "return lr / max(1, staleness)", "return lr * max(1, staleness)")
    carol = edit(carol, "            version += 1\n", "")
    carol = edit(carol, "torch.tensor([PUSH, int(version)])", "torch.tensor([PUSH, 0])")
    carol = edit(
        carol,
        "    mine = order.subset(split(len(order), comm.world_size, comm.rank))\n",
        "    mine = order  # everything, on every rank\n",
    )
    dave = edit(solution, "    send_rows(comm, torch.tensor([DONE, 0]), 0)\n", "")
    erin = edit(
        solution, "import torch\n", "import torch\nimport minidist_extras  # not installed anywhere\n"
    )
    library = edit(
        solution,
        "import torch\n",
        "import torch\nfrom minidist.glove.trainers.hogwild import hogwild_worker as library_hogwild\n",
    )
    library = replace_function(library, "hogwild_worker", LIBRARY_HOGWILD)
    hidden = edit(
        solution, "import torch\n", "import torch\nfrom minidist.bench import glove as bench_glove\n"
    )
    hidden = replace_function(hidden, "hogwild_worker", HIDDEN_HOGWILD)
    waiting = function_source(solution, "ps_worker").replace("def ps_worker(", "def prefetching_worker(", 1)
    library_worker = replace_function(solution, "prefetching_worker", waiting)
    texts = (solution, bob, carol, dave, erin, library, hidden, library_worker)
    return {name: {FILE: text.encode()} for name, text in zip(EXPECTED, texts)}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()
