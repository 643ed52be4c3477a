"""What the hidden tests of assignment 8 run inside the worker processes, and their inputs.

The student's ``experts`` is imported only here, inside the processes ``md.launch`` starts. Every
job takes JSON arguments only (a *spec*: sizes and a seed) and builds its tensors from them with
``torch.Generator``s; the trusted side (``reference.py``) builds the same from the same spec.
Nothing here routes, dispatches or exchanges: the answers are computed on the trusted side only
(this file is readable in the sandbox). What a rank reports besides the student's results, by
the grader's own instruments:

* the bytes and messages the *transport* sent during each call (``comm.stats`` of the
  launcher's communicator, which the submission never holds: it gets a ``StudentComm``), so a
  submission that rewrites what its own communicator reports changes nothing the grader reads;
  for the layer, from *before* it is built (a constructor that ships the experts counts) to the
  end of the backward;
* for the layer, the transcript of the messages its ``StudentComm`` sent (``record=True``), the
  construction and forward apart from the backward: the trusted side checks that each token's
  row reached, in the forward, every rank that holds one of its kept experts (a layer computed
  without sending the tokens -- rebuilding the other ranks' inputs from their seeds -- fails).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

if __package__:  # under pytest: grader.a8_experts.workers
    from .. import guard
    from ..seeding import seeded_
    from ..student_comm import CounterSeal, StudentComm, transcript
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    from seeding import seeded_
    from student_comm import CounterSeal, StudentComm, transcript

STUDENT_MODULE = "experts"
COUNTERS = CounterSeal()  # made now, before the student's module is imported
DTYPES = {"float64": torch.float64, "float32": torch.float32, "int64": torch.int64}


def student():
    """The student's module, imported once the guard refuses the library's all-to-all and experts."""
    guard.install_rules(rules)
    return importlib.import_module(STUDENT_MODULE)


def generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key)) % 2**61
    return torch.Generator().manual_seed(seed)


def draw(shape, dtype: str, *keys: int) -> torch.Tensor:
    """A tensor of ``shape`` from ``keys`` alone: normal floats, or integers in [-1000, 1000)."""
    g = generator(*keys)
    if dtype == "int64":
        return torch.randint(-1000, 1000, tuple(shape), generator=g, dtype=torch.int64)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64).to(DTYPES[dtype])


def sent(comm) -> tuple[int, int]:
    return COUNTERS.sent(comm)


# --- task 1 ------------------------------------------------------------------------------------
def equal_input(spec: dict, index: int, rank: int, world: int) -> torch.Tensor:
    piece = spec["pieces"][index]
    return draw([world, *piece["shape"]], piece["dtype"], spec["seed"], index, rank)


def uneven_input(spec: dict, rank: int) -> list[torch.Tensor]:
    rows, trailing = spec["rows"][rank], spec["trailing"]
    return [draw([n, *trailing], "float32", spec["seed"], rank, j) for j, n in enumerate(rows)]


def exchange_equal(comm, spec: dict) -> dict:
    """The student's ``all_to_all`` on every (world, *shape) input of the spec, one call each."""
    experts = student()
    mine = StudentComm(comm)
    outs, inputs_after, traffic = [], [], []
    for index in range(len(spec["pieces"])):
        x = equal_input(spec, index, comm.rank, comm.world_size)
        before = sent(comm)
        out = experts.all_to_all(mine, x)
        after = sent(comm)
        outs.append(out)
        inputs_after.append(x)
        traffic.append([after[0] - before[0], after[1] - before[1]])
    return {"outs": outs, "inputs_after": inputs_after, "traffic": traffic}


def exchange_uneven(comm, spec: dict) -> dict:
    """The student's ``all_to_all`` on this rank's uneven pieces: the sizes exchanged, then given."""
    experts = student()
    mine = StudentComm(comm)
    pieces = uneven_input(spec, comm.rank)
    before = sent(comm)
    exchanged = experts.all_to_all(mine, pieces)
    middle = sent(comm)
    given = experts.all_to_all(mine, pieces, [row[comm.rank] for row in spec["rows"]])
    after = sent(comm)
    return {
        "exchanged": list(exchanged),
        "given": list(given),
        "traffic": [
            [middle[0] - before[0], middle[1] - before[1]],
            [after[0] - middle[0], after[1] - middle[1]],
        ],
    }


# --- task 2 ------------------------------------------------------------------------------------
def routing(comm, spec: dict) -> dict:
    """The student's ``route`` on the logits of every problem of the spec (one process)."""
    experts = student()
    results = []
    for index, problem in enumerate(spec["problems"]):
        logits = draw([problem["tokens"], problem["experts"]], "float64", spec["seed"], index)
        logits = (logits * problem["scale"]).requires_grad_(True)
        chosen, gates, slots = experts.route(logits, problem["top_k"], problem["capacity_factor"])
        (grad,) = torch.autograd.grad(
            (gates * draw(gates.shape, "float64", spec["seed"], index, 1)).sum(), logits
        )
        results.append({"experts": chosen, "gates": gates.detach(), "slots": slots, "grad": grad})
    return {"results": results}


def synthetic_routing(problem: dict, *keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A valid (experts, slots, gates) drawn at random, not by any router: k distinct experts per
    token; each expert's choices shuffled, the first C of them given slots 0.., the others -1."""
    t, e, k, c = problem["tokens"], problem["experts"], problem["top_k"], problem["capacity"]
    g = generator(*keys)
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    slots = torch.full((t, k), -1, dtype=torch.int64)
    for expert in range(e):
        where = torch.nonzero(chosen == expert)
        where = where[torch.randperm(len(where), generator=g)][:c]
        slots[where[:, 0], where[:, 1]] = torch.arange(len(where))
    gates = torch.rand((t, k), generator=g, dtype=torch.float64)
    return chosen, slots, gates


def dispatching(comm, spec: dict) -> dict:
    """The student's ``dispatch`` and ``combine`` on a drawn routing, with their gradients."""
    experts = student()
    results = []
    for index, problem in enumerate(spec["problems"]):
        keys = (spec["seed"], index)
        chosen, slots, gates = synthetic_routing(problem, *keys)
        x = draw([problem["tokens"], problem["width"]], "float64", *keys, 1).requires_grad_(True)
        shape = [problem["experts"], problem["capacity"], problem["width"]]
        expert_out = draw(shape, "float64", *keys, 2).requires_grad_(True)
        gates.requires_grad_(True)
        buffer = experts.dispatch(x, chosen.clone(), slots.clone(), problem["experts"], problem["capacity"])
        y = experts.combine(expert_out, chosen.clone(), slots.clone(), gates)
        loss = (buffer * draw(shape, "float64", *keys, 3)).sum() + (
            y * draw(x.shape, "float64", *keys, 4)
        ).sum()
        grads = torch.autograd.grad(loss, [x, expert_out, gates], allow_unused=True)
        results.append({"buffer": buffer.detach(), "y": y.detach(), "grads": list(grads)})
    return {"results": results}


# --- tasks 3 and 4 -----------------------------------------------------------------------------
class Expert(nn.Module):
    """One expert: Linear(d, f) -> tanh -> Linear(f, d), float64."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def make_router(spec: dict) -> nn.Linear:
    router = nn.Linear(spec["width"], spec["experts"], bias=False)
    router = seeded_(router, spec["seed"] * 31 + 1).double()
    with torch.no_grad():
        router.weight.mul_(spec["router_scale"])
        if spec.get("starved"):  # these experts lose every token by far (tokens(): feature 0 is 4)
            router.weight[:, 0] = 3.0
            router.weight[spec["starved"], 0] = -3.0
    return router


def make_experts(spec: dict) -> list[Expert]:
    return [
        seeded_(Expert(spec["width"], spec["hidden"]), spec["seed"] * 31 + 2 + e).double()
        for e in range(spec["experts"])
    ]


def tokens(spec: dict, rank: int) -> torch.Tensor:
    x = draw([spec["tokens"], spec["width"]], "float64", spec["seed"], 100 + rank)
    if spec.get("starved"):
        x[:, 0] = 4.0
    return x


def output_weights(spec: dict, rank: int) -> torch.Tensor:
    """The loss of rank r is sum(y * w_r): every output element gets its own gradient."""
    return draw([spec["tokens"], spec["width"]], "float64", spec["seed"], 200 + rank)


def expert_parallel(comm, spec: dict) -> dict:
    """The student's ``ExpertParallelMoE``: one forward and one backward on this rank's tokens."""
    experts = student()
    p, rank = comm.world_size, comm.rank
    local = spec["experts"] // p
    router = make_router(spec)
    mine = make_experts(spec)[rank * local : (rank + 1) * local]
    x = tokens(spec, rank).requires_grad_(True)
    recorded = StudentComm(comm, record=True)
    start = sent(comm)  # before the layer is built: what its constructor sends counts
    layer = experts.ExpertParallelMoE(
        router, mine, recorded, spec["experts"], spec["top_k"], spec["capacity_factor"]
    )
    y = layer(x)
    middle = sent(comm)
    forward = transcript(recorded)
    (y * output_weights(spec, rank)).sum().backward()
    end = sent(comm)
    grad = lambda p: None if p.grad is None else p.grad.detach().clone()  # noqa: E731
    return {
        "y": y.detach(),
        "x_grad": grad(x),
        "router_grad": grad(router.weight),
        "expert_grads": [[grad(q) for q in expert.parameters()] for expert in mine],
        "forward": [middle[0] - start[0], middle[1] - start[1]],
        "backward": [end[0] - middle[0], end[1] - middle[1]],
        "forward_sent": _sent_per_peer(forward, p),
        "forward_messages": [_messages(forward, "send", q) for q in range(p)],
        "forward_received": [_messages(forward, "recv", q) for q in range(p)],
    }


def _sent_per_peer(taken: dict, world: int) -> list[torch.Tensor]:
    """The bytes of every message this rank sent to each rank, concatenated in order (uint8)."""
    pieces: list[list[torch.Tensor]] = [[] for _ in range(world)]
    data = taken["data"]
    for event in taken["events"]:
        if event["op"] == "send":
            size = event["numel"] * torch.empty(0, dtype=getattr(torch, event["dtype"])).element_size()
            pieces[event["peer"]].append(data[event["offset"] : event["offset"] + size])
    return [torch.cat(p) if p else torch.empty(0, dtype=torch.uint8) for p in pieces]


def _messages(taken: dict, op: str, peer: int) -> int:
    """How many messages this rank sent to ``peer`` (``op`` "send") or completed from it ("recv")."""
    return sum(1 for event in taken["events"] if event["op"] == op and event["peer"] == peer)
