"""Write example submissions of assignment 8, as an instructor would download them.

``python -m grader.examples.a8_experts.make OUT`` writes, into OUT:

* ``alice``: correct (the solution): 50 (3.996 rows per token on the measured test, the top
  tier: 4.6 rows; its floor, every token once to each rank holding any of its experts, is 3.875);
* ``lena``: a copy of the library's ``ExpertParallelMoE`` (its forward and its differentiable
  exchange, on the student's own ``route`` and ``all_to_all``): one row per kept choice whose
  expert lives on another rank, there and back, plus the counts: right everywhere, 7.313 rows
  per token (4 x remote choices / T = 7.3125, and 32 bytes of counts a rank), the second tier
  (5 of 10; ``PARTIAL``): 45;
* ``gina``: GShard's capacity-padded layout -- ``dispatch`` into (E, C, d), the whole buffer
  exchanged, the local experts on every slot, the whole buffer back, ``combine``: right
  everywhere, 16.0 rows per token (4 (p-1)/p E C / T: every slot, padding included), the third
  tier (2.5 of 10): 42.5;
* ``nora``: wrong: the differentiable all-to-all forgets its backward (it returns the plain
  exchange, cut from the graph): the output no longer depends on anything that requires grad,
  and ``backward`` raises: every test of ``ExpertParallelMoE`` fails, the measured one too (its
  check holds the gradients to one process first): 24;
* ``olga``: wrong: an off-by-one capacity (an expert keeps C + 1 choices): the routing test and
  the layer with drops fail; the measured layer drops nothing and keeps its points: 36;
* ``dan``: deadlocks: every rank sends all its pieces with a blocking ``send`` before it receives
  any: fine while messages fit a pipe's buffer, stuck on the equal exchange's 1 MB piece over
  pipes (its other tests pass): 44;
* ``frank``: delegating: ``all_to_all`` is ``md.all_to_all``: refused at intake, ``forbidden``;
* ``mo``: delegating: ``route`` is the library's router (``minidist.parallel.experts``): refused
  at intake, ``forbidden``;
* ``forger`` (hostile): gina's padded layout, and it makes its communicator's ``stats`` report
  what once-per-rank would send: the grader reads the transport's own counters, which the
  submission never holds: gina's value and tier, 42.5;
* ``oracle`` (hostile, found by a review): no communication at all -- each rank reads the job's
  spec in its working directory, rebuilds the other ranks' experts, tokens and loss weights from
  the seeds (the grader's ``seeded_`` written out: importing ``seeding`` is refused) and computes
  everything itself, adding the other ranks' share to its experts' gradients: output and
  gradients exact, 0 bytes. The transcript check fails it (no token's row reached the ranks of
  its experts): every layer test, 24;
* ``prefetch`` (hostile, found by a review): ships every rank's experts to every rank while the
  layer is built, computes the forward locally and sends the tokens only in the backward: exact,
  and 1.998 rows a token when counting began after the constructor. Now the constructor's bytes
  count (about 32 rows) and the rows never travelled in the forward: every layer test, 24.

``LOST`` lists the hidden tests each one fails; ``EXPECTED`` the status and score each must get
on all the hidden tests (``expected_score`` for a subset). The submissions are generated from
``solutions/`` and ``lib/`` (they follow both when they change); nothing here is committed but
this script.
"""

from __future__ import annotations

import re
from pathlib import Path

from grader.a8_experts.grading import ASSIGNMENT
from grader.examples import common
from grader.examples.common import edit, write

from .hostile import ORACLE, PREFETCH

ROOT = Path(__file__).resolve().parents[3]
SOLUTION = ROOT / "solutions" / "a8_experts" / "experts.py"
FILE = "experts.py"
LIBRARY = ROOT / "lib" / "minidist" / "parallel" / "experts" / "expert_parallel.py"

_ALL = tuple(t.name for t in ASSIGNMENT.graded_tests(0))
_LAYER = tuple(name for name in _ALL if name.startswith(("test_expert_parallel", "test_bytes")))
MEASURED = "test_bytes_per_token[2-shm]"

LOST = {
    "alice": ("ok", ()),
    "lena": ("ok", ()),
    "gina": ("ok", ()),
    "nora": ("ok", _LAYER),
    "olga": ("ok", ("test_routing", "test_expert_parallel[4-pipe-drops]")),
    "dan": ("ok", ("test_exchange_equal[3-pipe]",)),
    "frank": ("forbidden", _ALL),
    "mo": ("forbidden", _ALL),
    "forger": ("ok", ()),
    "oracle": ("ok", _LAYER),
    "prefetch": ("ok", _LAYER),
}

#: student -> {measured test: the fraction of its points earned} (the others: all or nothing)
PARTIAL = {"lena": {MEASURED: 0.5}, "gina": {MEASURED: 0.25}, "forger": {MEASURED: 0.25}}


def expected_score(student: str, tests: list[str] | None = None) -> float:
    """The points ``student`` must get on ``tests`` (default: every hidden test)."""
    points = {t.name: t.points for t in ASSIGNMENT.graded_tests(0)}
    tests = list(points) if tests is None else tests
    partial = PARTIAL.get(student, {})
    return sum(points[name] * partial.get(name, 1.0) for name in tests if name not in LOST[student][1])


EXPECTED = {student: (status, expected_score(student)) for student, (status, _) in LOST.items()}

FORWARD_BEGIN = "        ### BEGIN SOLUTION TODO(task 3): route, send, compute, send back, combine\n"
FORWARD_END = "        ### END SOLUTION\n"

PADDED = """        p, local, d = self.comm.world_size, len(self.experts), x.shape[1]
        experts, gates, slots = route(self.router(x), self.top_k, self.capacity_factor)
        c = capacity(x.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        buffer = dispatch(x, experts, slots, self.num_experts, c)  # (E, C, d): rank q's experts in row q
        arrived = all_to_all_differentiable(self.comm, list(buffer.view(p, local * c, d).unbind(0)))
        slots_here = torch.stack(arrived).view(p, local, c, d)
        done = torch.stack([expert(slots_here[:, e].reshape(p * c, d)).view(p, c, d)
                            for e, expert in enumerate(self.experts)], dim=1)  # (p, local, C, d)
        back = all_to_all_differentiable(self.comm, list(done.reshape(p, local * c, d).unbind(0)))
        return combine(torch.stack(back).view(self.num_experts, c, d), experts, slots, gates)
"""


def library_copy(solution: str) -> str:
    """The library's ExpertParallelMoE.forward and its ``_AllToAll``, pasted into the solution: the
    library's router and all_to_all replaced by the student's own ``route`` and ``all_to_all`` (the
    library's are refused), its ``routing.assignments()`` written out, the shared experts and the
    statistics dropped (the stub has neither)."""
    library = LIBRARY.read_text()
    function = library[library.index("class _AllToAll") : library.index("class ExpertParallelMoE")]
    start = library.index(
        "\n", library.index("    def forward(self, x", library.index("class ExpertParallelMoE"))
    )
    end = re.compile(r"^(class |def |# ---)", re.M).search(library, start)
    kept = []
    for line in library[start + 1 : end.start() if end else len(library)].rstrip().splitlines(keepends=True):
        if "routing = " in line:  # the library's router, by whichever path it calls it
            line = (
                "        chosen, gates, slots = route(self.router(flat), self.top_k, self.capacity_factor)\n"
            )
        elif "self.shared" in line or "self.aux_loss" in line or "self.received" in line:
            continue  # the shared experts, the statistics: not in the stub
        kept.append(line)
    body = "".join(kept) + "\n"
    body = edit(body, "routing.assignments()", "assignments(chosen, slots)")
    body = edit(body, "routing.gates[token, slot]", "gates[token, slot]")
    body = body.replace("self.per_rank", "len(self.experts)").replace("self.d_model", "x.shape[-1]")
    if "routing" in body.replace("# ", ""):
        raise ValueError(
            "the library's forward changed: it reads its routing in a way this copy does not know"
        )
    helper = (
        "def assignments(chosen, slots):\n"
        "    k = chosen.shape[1]\n"
        "    index = torch.nonzero((slots >= 0).reshape(-1)).squeeze(1)  # token, then choice\n"
        "    token, slot = index // k, index % k\n"
        "    expert = chosen[token, slot]\n"
        "    order = torch.sort(expert, stable=True).indices\n"
        "    return token[order], slot[order], expert[order]\n\n\n"
    )
    copied = forward(solution, body)
    return copied + "\n\n" + helper + function.replace("Communicator", "object").rstrip() + "\n"


FORGE = """        p = self.comm.world_size
        its_class = type(self.comm)
        before = self.comm.stats
        pretend = type(before)(before.bytes_sent // 4, before.messages_sent, before.bytes_received // 4,
                               before.messages_received)
        its_class.stats = property(lambda comm: pretend)  # what once per rank would have sent
"""

BLOCKING = """        for step in range(1, p):
            comm.send(sends[(rank + step) % p], (rank + step) % p)
        for step in range(1, p):
            comm.recv(recvs[(rank - step) % p], (rank - step) % p)
"""
PAIRWISE = """        for step in range(1, p):
            dst, src = (rank + step) % p, (rank - step) % p
            work = comm.isend(sends[dst], dst)
            comm.recv(recvs[src], src)
            work.wait()
"""


def replace_layer(solution: str, layer: str) -> str:
    """The solution with its ``ExpertParallelMoE`` class (the file's last definition) replaced."""
    return solution[: solution.index("class ExpertParallelMoE(nn.Module):")] + layer


def forward(solution: str, body: str) -> str:
    start = solution.index(FORWARD_BEGIN) + len(FORWARD_BEGIN)
    end = solution.index(FORWARD_END, start)
    return solution[:start] + body + solution[end:]


def build_dict() -> dict[str, dict[str, bytes]]:
    solution = SOLUTION.read_text()
    gina = forward(solution, PADDED)
    sources = {
        "alice": solution,
        "lena": library_copy(solution),
        "gina": gina,
        "nora": edit(
            solution,
            "    return list(AllToAll.apply(*pieces))\n",
            "    return all_to_all(comm, list(pieces), recv_sizes)  # no backward\n",
        ),
        "olga": edit(
            solution, "torch.where(queue < limit, queue, -1)", "torch.where(queue <= limit, queue, -1)"
        ),
        "dan": edit(solution, PAIRWISE, BLOCKING),
        "frank": edit(
            solution,
            "from minidist.comm import Communicator\n",
            "import minidist as md\nfrom minidist.comm import Communicator\n",
        ).replace(
            "    p, rank = comm.world_size, comm.rank\n\n    def exchange",
            "    if isinstance(chunks, torch.Tensor):\n        return md.all_to_all(comm, chunks)\n"
            "    p, rank = comm.world_size, comm.rank\n\n    def exchange",
        ),
        "mo": edit(
            solution,
            "    tokens, num_experts = logits.shape\n    probs",
            "    from minidist.parallel.experts.routing import route as library_route\n\n"
            "    decided = library_route(logits, top_k, capacity_factor)\n"
            "    del decided\n    tokens, num_experts = logits.shape\n    probs",
        ),
        "forger": edit(
            gina, PADDED, PADDED.replace("        return combine(", FORGE + "        return combine(")
        ),
        "oracle": replace_layer(solution, ORACLE),
        "prefetch": replace_layer(solution, PREFETCH),
    }
    return {name: {FILE: text.encode()} for name, text in sources.items()}


def build(out: Path) -> list[Path]:
    return write(out, build_dict())


def main() -> None:
    common.main(__doc__, build)


if __name__ == "__main__":
    main()
