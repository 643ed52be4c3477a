"""What the hidden tests of assignment 5 run inside the worker processes, and their inputs.

The student's ``tp_layers`` and ``schedule`` are imported only here, inside the processes
``md.launch`` starts, never in the pytest or grader process. Every job takes JSON arguments only
and builds its data from them; the trusted side (``reference.py``) builds the same data from the
same arguments. This module does not import pytest.

What a rank reports besides the values, measured by the grader's code:

* every call of the library's collectives (``CollectiveLog``: ``md.allreduce``,
  ``md.allgather``, ... are wrapped before the student's modules are imported), with the phase
  it came in (forward or backward), its number of elements and a copy of the tensor handed in
  (the trusted side compares it with this rank's share: its partial output, its partial input
  gradient -- a collective of zeros or of a dense result is seen);
* after ``load_dense`` the grader nudges every shard it was given (``nudge``, through the
  parameters the layer exposes) and the reference nudges the dense weights the same way: a
  layer that computes from a dense copy kept aside gives other values;
* in the pipeline, the stage module is the grader's (``tracked``): the layers run inside
  autograd Functions of the grader's that log the forwards and backwards in the order they ran
  (each backward with the forward it undid; a backward split into its input part B and its
  weight part W logs both) and count the microbatches held; the reported gradients are the ones
  its backwards computed from the gradients they were given (a replay with zero gradients adds
  zeros), and the stage shows no submodule and one parameter, a zero scalar that asks for the
  weight part (the layers, their graph and the log live in a closure, out of the student's
  reach; a forward of the layers that bypassed the stage is counted); ``run_stage`` gets a
  ``StudentComm`` (point-to-point only, its ``reset_stats`` raises) that counts messages and
  bytes per peer and keeps a copy of every tensor sent (``Recording``), compared with the
  activations and input gradients of the one-process model. The measured test times the order
  the stage logged, on the trusted side (``reference.emulated_time``).
"""

from __future__ import annotations

import functools
import importlib
import itertools

import torch
from torch import nn
from torch.nn import functional as F

if __package__:  # under pytest: grader.a5_model_parallel.workers
    from .. import guard
    from ..instruments import wrap_collectives
    from ..seeding import seeded_
    from ..student_comm import StudentComm
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    from instruments import wrap_collectives
    from seeding import seeded_
    from student_comm import StudentComm

COLLECTIVES = ("allgather", "allreduce", "broadcast", "reduce", "reduce_scatter")

# What the instruments rely on, bound now: this module is imported before the student's.
_CROSS_ENTROPY = F.cross_entropy
_NUMEL = torch.Tensor.numel
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_IS_TENSOR = torch.is_tensor
_GELU = F.gelu
_GRAD = torch.autograd.grad
_ENABLE_GRAD = torch.enable_grad
_ZEROS = torch.zeros
_TENSOR = torch.Tensor
_NO_SAVED_HOOKS = torch.autograd.graph.disable_saved_tensors_hooks
_FUNCTION_MODES = torch._C._len_torch_function_stack
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack


def _sealed(*tensors: torch.Tensor):
    """Where the grader runs the layers or differentiates them: no mode of the student's may see
    the calls (the weights are their arguments), no tensor subclass of theirs either (its
    ``__torch_function__`` would), no saved-tensor hook the tensors autograd saves (their grad_fn
    leads to the weights): each raises instead."""
    if any(type(t) is not _TENSOR for t in tensors):
        raise RuntimeError("a5: the grader's stage takes a plain tensor (torch.Tensor), not a subclass")
    if _FUNCTION_MODES() or _DISPATCH_MODES():
        raise RuntimeError("a5: the grader's stage runs its layers without torch-function or dispatch modes")
    return _NO_SAVED_HOOKS("a5: the grader's stage runs its layers without saved-tensor hooks")


# --- the grader's instruments ------------------------------------------------------------------
class CollectiveLog:
    """Wraps the library's collectives (under every public name) to log each call; ``phase`` tags them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.phase: str | None = None
        self.step: int | None = None
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        wrap_collectives(COLLECTIVES, self._wrap)

    def _wrap(self, name: str, original):
        @functools.wraps(original)
        def collective(comm, tensor, *args, **kwargs):
            numel = int(_NUMEL(tensor)) if _IS_TENSOR(tensor) else -1
            # what was handed in, copied now: the trusted side compares it with this rank's
            # partial result, so that a collective of zeros (or of anything else) is seen
            given = _CLONE(_DETACH(tensor)) if _IS_TENSOR(tensor) else None
            self.calls.append(
                {"phase": self.phase, "step": self.step, "function": name, "numel": numel, "given": given}
            )
            return original(comm, tensor, *args, **kwargs)

        return collective


_LOG = CollectiveLog()


def student(name: str):
    """One of the student's modules, imported after the guard refuses the library's versions."""
    guard.install_rules(rules)
    _LOG.install()
    return importlib.import_module(name)


# --- data (float64 for the tensor-parallel layers) --------------------------------------------
def tensor(spec: dict, what: str, rank: int = 0, shape=None) -> torch.Tensor:
    """A float64 normal tensor, the same for the same (seed, what, rank)."""
    salt = sum(ord(c) * 31**i for i, c in enumerate(what)) % 100_003
    g = torch.Generator().manual_seed(spec["seed"] * 1_000_003 + salt * 101 + rank)
    return torch.randn(*(shape or spec["shape"]), generator=g, dtype=torch.float64)


def dense_linear(spec: dict):
    """The dense (d_out, d_in) weight, bias (or None), input (..., d_in) and upstream gradient."""
    lead = [spec["batch"], spec["seq"]]
    weight = tensor(spec, "weight", shape=[spec["d_out"], spec["d_in"]])
    bias = tensor(spec, "bias", shape=[spec["d_out"]]) if spec["bias"] else None
    x = tensor(spec, "input", shape=[*lead, spec["d_in"]])
    return weight, bias, x, tensor(spec, "upstream", shape=[*lead, spec["d_out"]])


def nudge(spec: dict, what: str, rank: int, shape) -> torch.Tensor:
    """The change the grader makes to a rank's shard after ``load_dense`` (a tenth of a normal
    draw): the layer must compute with the parameters it exposes, not with a copy of the dense
    weights kept aside. A replicated parameter gets the same change on every rank (rank -1)."""
    return 0.1 * tensor(spec, "nudge " + what, rank + 1, shape=list(shape))


def _nudge_(parameter, spec: dict, what: str, rank: int) -> None:
    if _IS_TENSOR(parameter):
        with torch.no_grad():
            parameter.add_(nudge(spec, what, rank, parameter.shape))


class DenseMLP(nn.Module):
    """``minidist.models.transformer.MLP``'s layout (``up``, exact GELU, ``down``), float64."""

    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, ffn, dtype=torch.float64)
        self.down = nn.Linear(ffn, d, dtype=torch.float64)

    def forward(self, x):
        return self.down(_GELU(self.up(x)))


def dense_mlp(spec: dict) -> DenseMLP:
    return seeded_(DenseMLP(spec["d"], spec["ffn"]), spec["seed"])


def mlp_input(spec: dict) -> torch.Tensor:
    return tensor(spec, "mlp input", shape=[spec["batch"], spec["seq"], spec["d"]])


def mlp_upstream(spec: dict) -> torch.Tensor:
    return tensor(spec, "mlp upstream", shape=[spec["batch"], spec["seq"], spec["d"]])


def _grad(t):
    return None if t is None or t.grad is None else _CLONE(t.grad)


# --- jobs: tensor parallel ------------------------------------------------------------------
def operators(comm, spec: dict) -> dict:
    """f and g on a rank-dependent x with a rank-dependent upstream gradient."""
    torch.set_default_dtype(torch.float64)
    tp = student("tp_layers")
    x = tensor(spec, "x", comm.rank).requires_grad_()
    up = tensor(spec, "up", comm.rank)
    _LOG.calls.clear()
    out = {}
    for name, op in (("f", tp.copy_to_tensor_parallel), ("g", tp.reduce_from_tensor_parallel)):
        x.grad = None
        _LOG.phase = f"{name} forward"
        y = op(x, comm)
        out[f"{name}_out"] = _CLONE(_DETACH(y))
        _LOG.phase = f"{name} backward"
        (y * up).sum().backward()
        _LOG.phase = None
        out[f"{name}_grad"] = _grad(x)
    out["x_after"] = _CLONE(_DETACH(x))
    out["calls"] = list(_LOG.calls)
    return out


def linear(comm, spec: dict) -> dict:
    """A column- or row-parallel layer loaded from the dense one; output and gradients."""
    torch.set_default_dtype(torch.float64)
    tp = student("tp_layers")
    weight, bias, x, upstream = dense_linear(spec)
    p, r = comm.world_size, comm.rank
    if spec["kind"] == "column":
        layer = tp.ColumnParallelLinear(
            spec["d_in"], spec["d_out"], comm, bias=spec["bias"], gather_output=spec["gather_output"]
        )
        if not spec["gather_output"]:
            upstream = upstream[..., r * spec["d_out"] // p : (r + 1) * spec["d_out"] // p]
    else:
        layer = tp.RowParallelLinear(
            spec["d_in"], spec["d_out"], comm, bias=spec["bias"], input_is_parallel=spec["input_is_parallel"]
        )
        if spec["input_is_parallel"]:
            x = _CLONE(x[..., r * spec["d_in"] // p : (r + 1) * spec["d_in"] // p])
    layer.load_dense(weight, bias)
    _nudge_(layer.weight, spec, "weight", r)
    if spec["bias"]:
        _nudge_(layer.bias, spec, "bias", r if spec["kind"] == "column" else -1)
    x.requires_grad_()
    _LOG.calls.clear()
    _LOG.phase = "forward"
    out = layer(x)
    _LOG.phase = "backward"
    (out * upstream).sum().backward()
    _LOG.phase = None
    return {
        "calls": list(_LOG.calls),
        "out": _CLONE(_DETACH(out)),
        "x_grad": _grad(x),
        "weight_grad": _grad(layer.weight),
        "bias_grad": _grad(layer.bias) if spec["bias"] else None,
    }


def mlp(comm, spec: dict) -> dict:
    """The student's ParallelMLP loaded from the dense one, called ``calls`` times; output,
    gradients (of the first call) and every collective, tagged with the call and the phase."""
    torch.set_default_dtype(torch.float64)
    tp = student("tp_layers")
    _LOG.calls.clear()  # from here: a collective while the layer is built or loaded is counted too
    layer = tp.ParallelMLP(spec["d"], spec["ffn"], comm)
    layer.load_dense(dense_mlp(spec))
    r = comm.rank
    for name, parameter in layer.named_parameters():
        _nudge_(parameter, spec, name, -1 if name == "down.bias" else r)
    report = {}
    for step in range(spec.get("calls", 1)):
        x = mlp_input(spec).requires_grad_()
        _LOG.step, _LOG.phase = step, "forward"
        out = layer(x)
        _LOG.phase = "backward"
        (out * mlp_upstream(spec)).sum().backward()
        _LOG.step = _LOG.phase = None
        if step == 0:
            report = {
                "out": _CLONE(_DETACH(out)),
                "x_grad": _grad(x),
                "grads": {name: _grad(p) for name, p in layer.named_parameters()},
            }
    report["calls"] = list(_LOG.calls)
    return report


# --- jobs: the schedule -----------------------------------------------------------------------
def schedules(comm, cases: list[list[int]]) -> list:
    """The student's ``one_f_one_b(p, m)`` of each case, as plain lists."""
    schedule = student("schedule")
    return [[[list(a) for a in actions] for actions in schedule.one_f_one_b(p, m)] for p, m in cases]


# --- jobs: the executor -------------------------------------------------------------------------
def tracked(inner: nn.Module):
    """The grader's stage module and its log: ``(stage, log)``.

    ``stage(x)`` runs ``inner`` inside autograd Functions of the grader's::

        student's graph:   x ──> [Input] ──┐
                                            [Merge] ──> out ──> ... loss
                 stage.weights ─> [Weight] ─┘          (weights: a zero scalar, not the layers)
        grader's graph:    x' ─> inner(x') ─> out'   kept in ``records``, out of the student's reach

    ``Input``'s forward logs ``("F", j)`` and counts microbatch j as held. A backward through
    ``out`` reaches ``Input`` (the gradient of the stage's input, from ``inner``'s own graph),
    ``Weight`` (the gradients of ``inner``'s parameters, which land in ``log["grads"]``, the only
    gradients the grader reports), or both -- autograd runs only what leads to the tensors asked
    for: ``backward(..., inputs=[x])`` is the input part alone, ``inputs=list(stage.parameters())``
    the weight part alone, a plain ``backward`` both. Both in one call log ``("B", j)`` (a whole
    backward); apart, ``("B", j)`` and ``("W", j)`` in the order they ran. Microbatch j is held
    until both parts have run. A part run twice is logged with j = -1 and adds nothing; a part
    given zeros adds zeros. The student's side holds no way to the layers: ``stage`` has no
    submodule and one parameter, the zero scalar ``weights``; walking ``out.grad_fn`` reaches
    ``x``, ``weights`` and the grader's ``anchor`` (a zero that makes ``out`` require a gradient
    on stage 0), nothing else. A forward of ``inner`` or any of its modules that did not come
    through ``stage`` (were one ever reached another way) is counted in ``log["stray"]``. The
    log lives in this closure.
    """
    params = list(inner.parameters())
    log = {"live": 0, "peak": 0, "order": [], "stray": 0, "grads": [None] * len(params)}
    records: dict[int, dict] = {}  # id(ctx) of each Function node -> its microbatch's record
    alive: list = []  # the nodes, kept so that no id is reused while the log is read
    calls = itertools.count()  # one per backward that reaches a Merge: the parts of one call
    last_part: dict[int, tuple] = {}  # call -> (index in the order, microbatch, part) logged first
    serial = itertools.count()  # forwards are numbered in the order they ran (the schedules run
    # the microbatches' forwards in order 0, 1, ...); a backward names the forward it undoes
    inside, current = [False], [None]
    anchor = _ZEROS((), requires_grad=True)

    def stray(module, args):
        if not inside[0]:
            log["stray"] += 1

    for module in inner.modules():
        module.register_forward_pre_hook(stray)

    def note(ctx, record) -> None:
        records[id(ctx)] = record
        alive.append(ctx)

    def part(ctx, name: str):
        """The record of a part that runs now, or None (logged with -1) when it ran before."""
        record = records.get(id(ctx))
        call = record["call"] if record is not None else -1
        fresh = record is not None and not record[name]
        j = record["j"] if fresh else -1
        first = last_part.get(call)
        if first is not None and first[1] == j and first[2] != name:
            log["order"][first[0]] = ("B", j)  # both parts in one call: one whole backward
        else:
            log["order"].append(("B" if name == "input" else "W", j))
            last_part[call] = (len(log["order"]) - 1, j, name)
        if not fresh:
            return None
        record[name] = True
        if record["input"] and record["weight"]:
            log["live"] -= 1
        return record

    class Input(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, _anchor):
            j = next(serial)
            leaf = _DETACH(x).requires_grad_()
            inside[0] = True
            try:
                with _sealed(x, leaf), _ENABLE_GRAD():
                    out = inner(leaf)
            finally:
                inside[0] = False
            record = {"j": j, "leaf": leaf, "out": out, "input": False, "weight": False, "call": -1}
            note(ctx, record)  # nothing on ctx: out.grad_fn leads here
            current[0] = record
            log["live"] += 1
            log["peak"] = max(log["peak"], log["live"])
            log["order"].append(("F", j))
            return _CLONE(_DETACH(out))

        @staticmethod
        def backward(ctx, grad):
            record = part(ctx, "input")
            if record is None:
                return None, None
            with _sealed(grad):
                (g,) = _GRAD(record["out"], [record["leaf"]], grad, retain_graph=not record["weight"])
            return (g if ctx.needs_input_grad[0] else None), None

    class Weight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, _weights, like):
            note(ctx, current[0])
            return _ZEROS(like.shape, dtype=like.dtype)

        @staticmethod
        def backward(ctx, grad):
            record = part(ctx, "weight")
            if record is None:
                return None, None
            with _sealed(grad):
                grads = _GRAD(
                    record["out"], params, grad, retain_graph=not record["input"], allow_unused=True
                )
            for i, g in enumerate(grads):
                if g is not None:
                    total = log["grads"][i]
                    log["grads"][i] = _CLONE(g) if total is None else total + g
            return _ZEROS(()), None

    class Merge(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, _b):
            note(ctx, current[0])
            return _CLONE(a)

        @staticmethod
        def backward(ctx, grad):
            record = records.get(id(ctx))
            if record is not None:
                record["call"] = next(calls)
            return grad, grad

    class Tracked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = nn.Parameter(_ZEROS(()))  # asks for the weight part; holds nothing

        def forward(self, x):
            a = Input.apply(x, anchor)
            return Merge.apply(a, Weight.apply(self.weights, _DETACH(a)))

    return Tracked(), log


class Recording(StudentComm):
    """The student's communicator (point-to-point only, counted per peer) that also keeps a copy
    of every tensor sent, per destination, in order: the trusted side compares them with the
    activations and input gradients of the one-process model."""

    def __init__(self, comm, sent: dict) -> None:
        super().__init__(comm)
        self._sent = sent

    def send(self, tensor, dst: int, tag: int = 0) -> None:
        self._sent.setdefault(int(dst), []).append(_CLONE(_DETACH(tensor)))
        super().send(tensor, dst, tag)

    def isend(self, tensor, dst: int, tag: int = 0):
        self._sent.setdefault(int(dst), []).append(_CLONE(_DETACH(tensor)))
        return super().isend(tensor, dst, tag)


def make_stages(spec: dict) -> list[nn.Module]:
    """p stages of different kinds (float32); the last ends in a Linear to ``classes``."""
    w, p = spec["width"], spec["world_size"]
    stages = []
    for r in range(p):
        if r == 0:
            stages.append(nn.Sequential(nn.Linear(w, w), nn.GELU()))
        elif r < p - 1:
            stages.append(nn.Sequential(nn.LayerNorm(w), nn.Linear(w, w), nn.Tanh()))
        else:
            stages.append(nn.Sequential(nn.Linear(w, w), nn.Tanh(), nn.Linear(w, spec["classes"])))
    return [seeded_(stage, spec["seed"] * 101 + r) for r, stage in enumerate(stages)]


def whole(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def microbatches(spec: dict):
    g = torch.Generator().manual_seed(spec["seed"] + 17)
    rows, w = spec["rows"], spec["width"]
    xs = [torch.randn(rows, w, generator=g) for _ in range(spec["m"])]
    return xs, [torch.randint(0, spec["classes"], (rows,), generator=g) for _ in range(spec["m"])]


def pipeline(comm, spec: dict) -> dict:
    """Rank r runs stage r of ``make_stages`` with the student's ``run_stage`` and the given
    schedule (``spec["schedule"]``; None: the student's ``fast_schedule(p, m)``); its gradients,
    loss, peaks, the order of the work as the grader's stage logged it, and traffic (per peer,
    and a copy of every tensor sent)."""
    schedule = student("schedule")
    stage, log = tracked(make_stages(spec)[comm.rank])
    xs, ys = microbatches(spec)
    first, last = comm.rank == 0, comm.rank == comm.world_size - 1
    plan = spec["schedule"]
    if plan is None:  # the measured test: the student's own schedule, run by the student's step
        plan = schedule.fast_schedule(comm.world_size, spec["m"])
    actions = [(str(kind), int(j)) for kind, j in plan[comm.rank]]

    def loss_fn(out, target):
        return _CROSS_ENTROPY(out, target)

    sent: dict[int, list] = {}
    wrapped = Recording(comm, sent)
    result = schedule.run_stage(
        stage,
        wrapped,
        actions,
        xs if first else None,
        ys if last else None,
        loss_fn,
        (spec["rows"], spec["width"]),
    )
    traffic = student_traffic(wrapped)
    loss = getattr(result, "loss", "missing")
    return {
        "loss": float(loss)
        if isinstance(loss, (int, float, torch.Tensor))
        else None
        if loss is None
        else str(loss),
        "peak": int(getattr(result, "peak_in_flight", -1)),
        "measured_peak": log["peak"],
        "order": [[kind, j] for kind, j in log["order"]],
        "traffic": traffic,
        "sent": {str(dst): tensors for dst, tensors in sorted(sent.items())},
        "stray": log["stray"],
        "grads": log["grads"],
    }


def student_traffic(comm) -> dict:
    return comm._traffic.as_dict()
