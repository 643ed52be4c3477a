"""What the hidden tests of assignment 9 run inside the worker processes, and their inputs.

The student's ``resilient`` is imported only here, inside the processes ``md.launch`` starts. Every
job takes JSON arguments only (a *spec*: sizes, a schedule and a seed) and builds its tensors from
them with ``torch.Generator``s; the trusted side (``reference.py``) builds the same from the same
spec. Nothing here takes an outer step, averages or replays: the answers are computed on the
trusted side only (this file is readable in the sandbox). What a rank reports besides the
student's results, by the grader's own instruments: the bytes the *transport* sent
(``comm.stats`` of the launcher's communicator, which the submission never holds: it gets a
``StudentComm``).

The quorum jobs run an elastic launch of their own: the job's one process (which never imports
the student's code) calls ``md.launch(quorum_rank, k, transport="pipe", elastic=Policy(...))``;
each rank installs the guard, imports the student's module and trains with the library's
``FaultTolerant`` given the student's ``exchange`` and ``average``, SIGKILLing itself where the
spec's kill schedule says. The launcher (in the job's process) starts the replacements.
"""

from __future__ import annotations

import importlib
import os
import signal

import torch

import minidist as md

if __package__:  # under pytest: grader.a9_resilient.workers
    from .. import guard
    from ..student_comm import CounterSeal, StudentComm
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    from student_comm import CounterSeal, StudentComm

STUDENT_MODULE = "resilient"
COUNTERS = CounterSeal()  # made now, before the student's module is imported


def student():
    """The student's module, imported once the guard refuses the library's DiLoCo and exchange."""
    importlib.import_module("minidist.parallel.local_sgd")  # loaded, so that the guard finds its functions
    importlib.import_module("minidist.parallel.elastic.step")
    guard.install_rules(rules)
    return importlib.import_module(STUDENT_MODULE)


def generator(*keys: int) -> torch.Generator:
    seed = 0
    for key in keys:
        seed = (seed * 1_000_003 + int(key)) % 2**61
    return torch.Generator().manual_seed(seed)


def draw(shape, *keys: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator(*keys), dtype=torch.float64)


def sent(comm) -> int:
    return COUNTERS.sent(comm)[0]


# --- task 1 ------------------------------------------------------------------------------------
def outer_and_schedule(comm, spec: dict) -> dict:
    """The student's ``nesterov_step_`` over a few rounds and ``fragments_due`` over a table (one process)."""
    resilient = student()
    rounds = []
    for index, problem in enumerate(spec["outer"]):
        n = problem["numel"]
        params, momentum = draw([n], spec["seed"], index, 0), torch.zeros(n, dtype=torch.float64)
        for r in range(problem["rounds"]):
            resilient.nesterov_step_(
                params, momentum, draw([n], spec["seed"], index, r + 1), *problem["lr_mu"]
            )
        rounds.append({"params": params, "momentum": momentum})
    due = []
    for inner_steps, fragments, steps in spec["schedules"]:
        due.append([list(resilient.fragments_due(t, inner_steps, fragments)) for t in range(1, steps + 1)])
    return {"rounds": rounds, "due": due}


# --- task 2 ------------------------------------------------------------------------------------
def regression_params(spec: dict) -> list[torch.Tensor]:
    """The worker's model: a (inputs x outputs) weight and a bias, the same on every worker."""
    return [
        draw([spec["inputs"], spec["outputs"]], spec["seed"], 0),
        draw([spec["outputs"]], spec["seed"], 1),
    ]


def regression_batch(spec: dict, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``rank``'s batch at ``step``: y = x T + rank (the workers' data differ) + noise."""
    x = draw([spec["batch"], spec["inputs"]], spec["seed"], 2, rank, step)
    noise = draw([spec["batch"], spec["outputs"]], spec["seed"], 3, rank, step)
    return x, x @ teacher(spec) + rank + spec.get("noise", 1.0) * noise


def teacher(spec: dict) -> torch.Tensor:
    return draw([spec["inputs"], spec["outputs"]], spec["seed"], 4)


def heldout_loss(spec: dict, world: int, flat: torch.Tensor) -> float:
    """The mean squared error of parameters ``flat`` on every worker's distribution, without noise."""
    n = spec["inputs"] * spec["outputs"]
    weight, bias = flat[:n].view(spec["inputs"], spec["outputs"]), flat[n:]
    x = draw([64, spec["inputs"]], spec["seed"], 5)
    losses = [((x @ weight + bias - x @ teacher(spec) - r) ** 2).mean() for r in range(world)]
    return float(sum(losses) / world)


def inner_step(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float) -> None:
    """One inner step: plain gradient descent on the mean squared error (the grader's, not graded)."""
    weight, bias = (p.detach().requires_grad_(True) for p in params)
    loss = ((x @ weight + bias - y) ** 2).mean()
    grads = torch.autograd.grad(loss, (weight, bias))
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g)


def streaming(comm, spec: dict) -> dict:
    """Inner steps on this worker's batches, the student's ``StreamingSync`` after each; its local
    parameters after every step, and after ``flush`` when the spec asks for it."""
    resilient = student()
    params = regression_params(spec)
    sync = resilient.StreamingSync(
        StudentComm(comm),
        params,
        spec["inner_steps"],
        fragments=spec["fragments"],
        delay=spec["delay"],
        mix=spec["mix"],
        outer_lr=spec["outer_lr"],
        outer_momentum=spec["outer_momentum"],
    )
    trajectory, traffic = [], []
    for step in range(1, spec["steps"] + 1):
        inner_step(params, *regression_batch(spec, comm.rank, step), spec["inner_lr"])
        before = sent(comm)
        sync.after_inner_step()
        traffic.append(sent(comm) - before)
        trajectory.append(torch.cat([p.detach().reshape(-1) for p in params]))
    if spec["flush"]:
        sync.flush()
    return {
        "trajectory": trajectory,
        "final": torch.cat([p.detach().reshape(-1) for p in params]),
        "traffic": traffic,
    }


# --- task 3 ------------------------------------------------------------------------------------
class MomentumSGD:
    """v <- mu v + g, then p <- p - lr v: the grader's optimizer (state_dict for the recovery)."""

    def __init__(self, params, lr: float, mu: float) -> None:
        self.params, self.lr, self.mu = list(params), lr, mu
        self.buffers = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        for p, v in zip(self.params, self.buffers):
            v.mul_(self.mu).add_(p.grad)
            p.sub_(self.lr * v)

    def state_dict(self) -> dict:
        return {"buffers": [v.clone() for v in self.buffers]}

    def load_state_dict(self, state: dict) -> None:
        for mine, theirs in zip(self.buffers, state["buffers"]):
            mine.copy_(theirs)


def quorum_model(spec: dict) -> torch.nn.Module:
    model = torch.nn.Linear(spec["inputs"], spec["outputs"], dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(draw(model.weight.shape, spec["seed"], 0))
        model.bias.copy_(draw(model.bias.shape, spec["seed"], 1))
    return model


def quorum_loss(model: torch.nn.Module, spec: dict, slot: int, step: int) -> torch.Tensor:
    x = draw([spec["batch"], spec["inputs"]], spec["seed"], 2, slot, step)
    y = draw([spec["batch"], spec["outputs"]], spec["seed"], 3, slot, step)
    return ((model(x) - y) ** 2).mean()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _DyingComm(StudentComm):
    """The student's communicator; SIGKILLs this process right after its first gradient send of
    step ``step`` has completed (a death in the middle of the exchange)."""

    def __init__(self, comm, step: int) -> None:
        super().__init__(comm)
        self._die_at = step

    def isend(self, tensor, dst, tag=0):
        work = super().isend(tensor, dst, tag)
        if tag == self._die_at + 1:
            work.wait()
            _die()
        return work

    def send(self, tensor, dst, tag=0):
        out = super().send(tensor, dst, tag)
        if tag == self._die_at + 1:
            _die()
        return out


def quorum_rank(comm, spec: dict) -> dict:
    """One rank of the elastic run: FaultTolerant with the student's exchange and average."""
    from minidist.parallel import elastic

    resilient = student()
    slot, incarnation = elastic.identity()
    point, die_step = "", -1
    for k_slot, k_incarnation, k_point, k_step in spec["kills"]:
        if (k_slot, k_incarnation) == (slot, incarnation):
            point, die_step = k_point, k_step
    model = quorum_model(spec)
    optimizer = MomentumSGD(model.parameters(), spec["lr"], spec["mu"])
    traffic: list[list[int]] = []

    def on_point(name: str, step: int) -> None:
        if step == die_step and name == point:
            _die()

    def exchange(real_comm, flat, members, me, step):
        mine = _DyingComm(real_comm, die_step) if point == "mid_exchange" else StudentComm(real_comm)
        before = sent(real_comm)
        held = resilient.exchange(mine, flat, list(members), me, step)
        traffic.append([step, len(members), sent(real_comm) - before, flat.numel() * flat.element_size()])
        return held

    ft = elastic.FaultTolerant(
        comm, model, optimizer, spec["steps"], on_point=on_point, exchange=exchange, average=resilient.average
    )
    while ft.step < spec["steps"]:
        if ft.train_step(lambda step: quorum_loss(model, spec, slot, step)) is None:
            break
    return {
        "incarnation": incarnation,
        "history": ft.history,
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": optimizer.state_dict()["buffers"],
        "traffic": traffic,
    }


def quorum(comm, spec: dict) -> dict:
    """The job's one process: an elastic launch of ``quorum_rank`` (it never imports the student's
    code itself). A launch that does not finish is reported as a deadlock, not waited out."""
    from minidist.parallel import elastic

    try:
        outs = md.launch(
            quorum_rank,
            spec["ranks"],
            args=(spec,),
            transport="pipe",
            timeout=spec["timeout"],
            start_method="forkserver",  # elastic launches refuse fork: a replacement must not inherit pipes
            elastic=elastic.Policy(min_size=spec["min_size"], max_restarts=spec["max_restarts"]),
        )
    except md.LaunchTimeout as error:
        raise TimeoutError(
            f"the elastic run on {spec['ranks']} ranks did not finish within {spec['timeout']} s: a "
            f"deadlock in exchange? (gradient {spec['inputs'] * spec['outputs'] * 8} bytes; a pipe "
            f"buffers 1 MiB) {str(error)[-600:]}"
        ) from None
    return {"slots": outs}


# --- task 4, measured --------------------------------------------------------------------------
DESIGN_KEYS = ("inner_steps", "fragments", "delay", "mix", "outer_lr", "outer_momentum")


def design_of(resilient, steps: int, numel: int) -> dict:
    """The student's ``design()`` (a dict of ``DESIGN_KEYS``), checked, as plain numbers."""
    design = resilient.design()
    if not isinstance(design, dict) or set(design) != set(DESIGN_KEYS):
        raise ValueError(f"design() must return a dict with exactly the keys {DESIGN_KEYS}, got {design!r}")
    out = {k: int(design[k]) for k in DESIGN_KEYS[:3]} | {k: float(design[k]) for k in DESIGN_KEYS[3:]}
    h, f, tau = out["inner_steps"], out["fragments"], out["delay"]
    if not (1 <= f <= h <= steps and f <= numel and 0 <= tau < h and 0.0 <= out["mix"] < 1.0):
        raise ValueError(
            f"design() needs 1 <= fragments <= inner_steps <= {steps} (the run's steps), fragments <= "
            f"{numel} (the parameters), 0 <= delay < inner_steps, 0 <= mix < 1: {out}"
        )
    return out


def measured(comm, spec: dict) -> dict:
    """The measured run: ``spec["steps"]`` inner steps with the student's ``design()``; rank 0 reports
    its parameters after every step and the transport's cumulative bytes and messages."""
    resilient = student()
    design = design_of(resilient, spec["steps"], spec["inputs"] * spec["outputs"] + spec["outputs"])
    params = regression_params(spec)
    sync = resilient.StreamingSync(StudentComm(comm), params, **design)
    trajectory, traffic = [], []
    for step in range(1, spec["steps"] + 1):
        inner_step(params, *regression_batch(spec, comm.rank, step), spec["inner_lr"])
        sync.after_inner_step()
        trajectory.append(torch.cat([p.detach().reshape(-1) for p in params]))
        traffic.append(list(COUNTERS.sent(comm)))
    return {"design": design, "trajectory": trajectory, "traffic": traffic}
