"""Write example submissions of assignment 7, as an instructor would download them.

``python -m grader.examples.a7_zero.make OUT`` writes, into OUT:

* ``alice``: correct (the solution): 42 (1.54x on the measured test, the top tier: 1.60x);
* ``bob``: partial: ``ShardedAdamW`` only, ``ShardedStack`` left as the stub (task 1's 16);
* ``carol``: wrong: no padding -- every rank takes ``numel // N`` elements, so a parameter
  count that N does not divide loses its last elements (every hidden stack has one; the
  measured stack, 33,088 a unit on 2 ranks, has none: carol keeps its 8 points);
* ``dave``: wrong: sums the gradients instead of averaging them (``op="sum"``): the collectives
  and bytes are right (10 points), every value is not;
* ``frank``: delegating: ``ShardedAdamW`` is the library's ``ZeroOptimizer``: refused at intake,
  status ``forbidden``;
* ``lena``: a copy of the library's ``ZeroOptimizer`` (stage 2) and ``FullyShardedModule``
  (its units the stack's layers), adapted to the stub's names: right everywhere, and 1.81x on
  the measured test, the second tier (4 of its 8 points; ``PARTIAL``);
* ``hoarder`` (hostile): the solution, but every unit's gathered weights also kept in a dict
  that the layers do not reach: the layers are emptied after use as the census of blocks holding
  weights wants, so it forges that count and keeps the communication tests; the profiler sees
  the hoard, 4 Psi more at the peak (the third tier, 2 of 8);
* ``pauser`` (hostile): the solution with the profiler switched off around its backward
  (``torch.autograd.profiler``) so that the measured peak would miss it: refused at intake;
* ``lister`` (hostile): AdamW's moments kept as Python lists (``.tolist()``), outside torch's
  allocator, so that the measured peak would miss them: refused at intake;
* ``threaded`` (hostile, found by a review): the solution with its optimizer step run in a
  ``threading.Thread``, whose allocations torch's profiler (which counts its own thread's) does
  not see -- a review's version of it measured 0.79x, below the model states themselves: refused
  at intake (and a peak below 16 Psi / N fails the measured test);
* ``sender`` (hostile, found by a review): a full AdamW on every rank (no sharded state) whose
  allgather carries the averaged gradient instead of the updated shard -- ZeRO-2's counts and
  bytes, DDP's memory: the trusted side compares what each collective carries with the rank's
  own gradient and updated shard, and fails task 1's three tests.

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` the status and score each must get
on all the hidden tests (``expected_score`` for a subset). The submissions are generated from
``solutions/`` and ``lib/`` (they follow both when they change); nothing here is committed but
this script.
"""

from __future__ import annotations

import re
from pathlib import Path

from grader.a7_zero.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a7_zero" / "zero.py"
STUB = ROOT / "assignments" / "a7_zero" / "zero.py"
LIBRARY = ROOT / "lib" / "minidist" / "parallel" / "zero"
FILE = "zero.py"

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))
_ZERO2 = tuple(name for name in _ALL if name.startswith("test_zero2"))
_ZERO3 = tuple(name for name in _ALL if name.startswith("test_zero3"))
_VALUES = tuple(name for name in _ALL if "values" in name)
MEASURED = "test_peak_memory[2-shm]"

LOST = {
    "alice": ("ok", ()),
    "bob": ("ok", (*_ZERO3, MEASURED)),
    "carol": ("ok", (*_ZERO2, *_ZERO3)),
    "dave": ("ok", (*_VALUES, MEASURED)),
    "frank": ("forbidden", _ALL),
    "lena": ("ok", ()),
    "hoarder": ("ok", ()),
    "pauser": ("forbidden", _ALL),
    "lister": ("forbidden", _ALL),
    "threaded": ("forbidden", _ALL),
    "sender": ("ok", _ZERO2),
}

#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"lena": {MEASURED: 0.5}, "hoarder": {MEASURED: 0.25}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}


def _class(source: str, name: str) -> str:
    """The text of ``class name`` in ``source``, up to the next top-level definition or comment rule."""
    start = source.index(f"class {name}")
    end = re.compile(r"^(class |def |# ---)", re.M).search(source, start + 1)
    return source[start : end.start() if end else len(source)]


def library_copy(solution: str) -> str:
    """The library's ZeroOptimizer and FullyShardedModule, pasted into the stub's module with the
    imports made absolute, the private calls across objects and ``object.__setattr__`` replaced (the
    intake refuses them),
    and the stub's two classes as thin adapters."""
    optimizer = (LIBRARY / "optimizer.py").read_text()
    sharded = (LIBRARY / "fully_sharded.py").read_text()
    helpers = optimizer[optimizer.index("def _check_stage") : optimizer.index("class ZeroOptimizer")]
    body = helpers + _class(optimizer, "ZeroOptimizer") + sharded[sharded.index("def default_units") :]
    body = body.replace("self.module", "self.wrapped[0]").replace(":{type(unit).__name__}", "")
    body = body.replace('object.__setattr__(self, "module", module)', "self.wrapped = [module]")
    for private, public in (("_trace(", "trace_event("), ("_note_gathered(", "note_gathered(")):
        body = body.replace(private, public)
    header = (
        '"""zero.py: the library\'s ZeRO, copied."""\n\nfrom __future__ import annotations\n\n'
        "import time\nimport zlib\nfrom collections.abc import Iterable\n\n"
        "import torch\nfrom torch import nn\n\n"
        "from minidist.collectives import allgather, broadcast, reduce_scatter\n"
        "from minidist.comm import Communicator\n\n\n"
    )
    adapters = (
        "\n\nclass ShardedAdamW(ZeroOptimizer):\n"
        "    def __init__(self, params, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):\n"
        "        super().__init__(params, comm, stage=2, optimizer=torch.optim.AdamW, lr=lr, betas=betas,\n"
        "                         eps=eps, weight_decay=weight_decay)\n\n\n"
        "class ShardedStack(FullyShardedModule):\n"
        "    def __init__(self, layers, comm, prefetch=True):\n"
        "        super().__init__(nn.Sequential(*layers), comm, units=list(layers), prefetch=prefetch)\n"
    )
    return header + body + adapters


HOARD_INIT = "        pending: dict[int, object] = {}  # unit -> its allgather in flight\n"
HOARD_GATHER = "            rows = pending.pop(i).wait().view(-1)\n"
PAUSE_BACKWARD = "                    grads = list(torch.autograd.grad(out, wanted, grad_out))\n"
LIST_STEP = "        self.inner.step()\n"
THREAD_STEP = (
    "        worker = threading.Thread(target=self.inner.step)  # allocations the profiler does not see\n"
    "        worker.start()\n"
    "        worker.join()\n"
)
#: ``sender``'s ShardedAdamW: ZeRO-2's two collectives around a full AdamW
SENDER = """class ShardedAdamW:
    def __init__(self, params, comm, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        self.params, self.comm = list(params), comm
        self.numel = sum(p.numel() for p in self.params)
        self.padded = -(-self.numel // comm.world_size) * comm.world_size
        self.inner = torch.optim.AdamW(
            self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False
        )

    @torch.no_grad()
    def step(self) -> None:
        world = self.comm.world_size
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        flat = torch.cat([flat, flat.new_zeros(self.padded - self.numel)])
        mine = md.reduce_scatter(self.comm, flat.view(world, -1), op="avg").view(-1)
        full = md.allgather(self.comm, mine).view(-1)
        offset = 0
        for p in self.params:
            p.grad = full[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        self.inner.step()
        for p in self.params:
            p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


"""


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    stub = STUB.read_text()
    zero3_stub = stub[stub.index("class ShardedStack") :]
    bob = solution[: solution.index("class ShardedStack")] + zero3_stub
    carol = solution.replace("-(-self.numel // world) * world", "self.numel // world * world").replace(
        "-(-numel // world) * world", "numel // world * world"
    )
    dave = solution.replace('op="avg"', 'op="sum"')
    frank = edit(
        solution,
        "class ShardedAdamW:\n",
        "from minidist.parallel.zero import ZeroOptimizer  # noqa: E402\n\n\nclass ShardedAdamW:\n",
    )
    hoarder = edit(solution, HOARD_INIT, HOARD_INIT + "        hoard: dict[int, list] = {}\n")
    hoarder = edit(hoarder, HOARD_GATHER, HOARD_GATHER + "            hoard[i] = rows  # kept after free()\n")
    pauser = edit(
        solution,
        PAUSE_BACKWARD,
        "                    with torch.autograd.profiler.profile(enabled=False):\n    " + PAUSE_BACKWARD,
    )
    lister = edit(
        solution,
        LIST_STEP,
        LIST_STEP + "        self.kept = [s.tolist() for s in self.inner.state[self.shard].values()]\n",
    )
    threaded = edit(solution, LIST_STEP, THREAD_STEP)
    sender = (
        solution[: solution.index("class ShardedAdamW")]
        + SENDER
        + solution[solution.index("class ShardedStack") :]
    )
    sources = {
        "alice": solution,
        "bob": bob,
        "carol": carol,
        "dave": dave,
        "frank": frank,
        "lena": library_copy(solution),
        "hoarder": hoarder,
        "pauser": pauser,
        "lister": lister,
        "threaded": "import threading\n" + threaded,
        "sender": sender,
    }
    return {name: {FILE: text.encode()} for name, text in sources.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()
