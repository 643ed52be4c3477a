"""What the hidden tests of assignment 7 run inside the worker processes, and their inputs.

The student's ``zero`` is imported only here, inside the processes ``md.launch`` starts. Every
job takes JSON arguments only (a *spec*: the stack's widths, hidden size, seed, rows, steps) and
builds its blocks and data from them; the trusted side (``reference.py``) builds the same from
the same spec and trains them in one process. What a rank reports besides its parameters, by
the grader's own instruments:

* every call of a library collective during the steps (``CollectiveLog``: the collectives are
  wrapped before the student's module is imported): its name, elements, element size,
  ``async_op``, and the step it came in -- in ZeRO-2's jobs also a float64 copy of what it
  carries, which the trusted side compares with each rank's own gradient and updated shard
  (a rank that rebuilds the other ranks' data, or runs a full AdamW, sends something else);
  the student's code gets a ``StudentComm``
  (point-to-point only, counted), never the transport's communicator;
* the bytes the transport sent in each step (``comm.stats`` of the launcher's communicator);
* ``Census``: at every forward of a block and at every backward of one (an identity autograd
  Function on the block's output, so its backward runs just before the block's own), how many
  blocks of the stack hold their weights (a parameter with elements and storage) and how many
  allgathers were issued so far in the step;
* the measured job (``peak``): torch's profiler's allocation and free events (time, bytes,
  address) from the import of the student's module to the end of two training steps, and the
  window of the steps; the trusted side computes the peak from them. The profiler counts the
  allocations of the thread it runs in, so there every collective runs in the caller's thread
  (``async_op=True`` gets a handle already done): a gathered unit is counted from its
  allocation whatever the student asked for, and the peak does not depend on timing.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

if __package__:  # under pytest: grader.a7_zero.workers
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

STUDENT_MODULE = "zero"
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier")
#: eps large enough that the gradient's scale matters (a sum instead of the average shows)
ADAMW = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-4, "weight_decay": 0.1}
_NUMEL = torch.Tensor.numel
_ELEMENT_SIZE = torch.Tensor.element_size
_IS_TENSOR = torch.is_tensor
_NBYTES = torch.UntypedStorage.nbytes
_STORAGE = torch.Tensor.untyped_storage


class CollectiveLog:
    """Wraps the library's collectives to log each call during the steps (``_step`` set)."""

    def __init__(self) -> None:
        self._calls: list[dict] = []
        self._step: int | None = None
        self._synchronous = False  # the measured run: asynchronous collectives run at the call
        self._keep = False  # ZeRO-2's jobs: a float64 copy of what each logged call carries
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            self._installed = True
            wrap_collectives(COLLECTIVES, self._wrap)

    def issued(self, name: str) -> int:
        return sum(1 for call in self._calls if call["function"] == name and call["step"] == self._step)

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(comm, *args, **kwargs):
            try:
                bound = signature.bind(comm, *args, **kwargs)
                bound.apply_defaults()
                arguments = dict(bound.arguments)
            except TypeError:
                arguments = {}
            tensor = arguments.get("tensor")
            is_tensor = _IS_TENSOR(tensor)
            if self._step is not None:
                self._calls.append(
                    {
                        "function": name,
                        "step": int(self._step),
                        "numel": int(_NUMEL(tensor)) if is_tensor else -1,
                        "itemsize": int(_ELEMENT_SIZE(tensor)) if is_tensor else -1,
                        "async_op": bool(arguments.get("async_op", False)),
                        "op": str(arguments.get("op", "")),
                    }
                )
                if self._keep and is_tensor:  # what it carries, for the trusted side to compare
                    self._calls[-1]["input"] = tensor.detach().reshape(-1).to(torch.float64).clone()
            if isinstance(comm, StudentComm):  # run on the transport: its own path, its own bytes
                comm = comm._comm
            if self._synchronous and arguments.get("async_op", False):
                # the measured run: every allocation in this thread, where the profiler counts it
                kwargs = {k: v for k, v in arguments.items() if k != "comm"}
                kwargs["async_op"] = False
                return Done(original(comm, **kwargs))
            return original(comm, *args, **kwargs)

        return collective


class Done:
    """The handle of a collective the measured run executed at once: ``wait()`` gives its result."""

    __slots__ = ("wait", "is_completed")

    def __init__(self, result) -> None:
        self.wait = lambda timeout=None: result
        self.is_completed = lambda: True


_LOG = CollectiveLog()


def student():
    """The student's module, imported once the guard refuses the library's ZeRO and collectives are logged."""
    guard.install_rules(rules)
    _LOG.install()
    return importlib.import_module(STUDENT_MODULE)


# --- the stack and its census ----------------------------------------------------------------
class Census:
    """At every block's forward and backward: (kind, block, blocks holding weights, allgathers issued)."""

    def __init__(self) -> None:
        self._blocks: list[Block] = []
        self._events: list[list] = []

    def holding(self) -> int:
        return sum(block.holds() for block in self._blocks)

    def note(self, kind: str, index: int) -> None:
        self._events.append([kind, index, self.holding(), _LOG.issued("allgather"), _LOG._step])


class _Probe(torch.autograd.Function):
    """Identity; its backward notes the block's backward (it runs just before the block's own)."""

    @staticmethod
    def forward(ctx, x, census, index):
        ctx.census, ctx.index = census, index
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.census.note("B", ctx.index)
        return grad, None, None


class Block(nn.Module):
    """Linear -> tanh -> Linear; its forward and backward are noted by the census."""

    def __init__(self, d_in: int, hidden: int, d_out: int, census: Census, index: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        object.__setattr__(self, "_census", census)  # not a sub-module
        self._index = index

    def holds(self) -> bool:
        return any(_NUMEL(p) > 0 and _NBYTES(_STORAGE(p)) > 0 for p in self.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._census.note("F", self._index)
        out = self.down(torch.tanh(self.up(x)))
        return _Probe.apply(out, self._census, self._index) if out.requires_grad else out


def make_blocks(spec: dict, census: Census | None = None, dtype=torch.float64) -> list[Block]:
    census = census or Census()
    widths, hidden = spec["widths"], spec["hidden"]
    blocks = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        block = seeded_(Block(a, hidden[i], b, census, i), spec["seed"] * 31 + i).to(dtype)
        blocks.append(block)
    census._blocks = blocks
    return blocks


def batch(spec: dict, step: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(spec["seed"] * 7 + 1000 + step)
    rows = spec["rows"] * spec["ranks"]
    x = torch.randn(rows, spec["widths"][0], generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(rows, spec["widths"][-1], generator=g, dtype=torch.float64).to(dtype)
    return x, y


def local(spec: dict, rank: int, step: int, dtype=torch.float64):
    x, y = batch(spec, step, dtype)
    rows = slice(rank * spec["rows"], (rank + 1) * spec["rows"])
    return x[rows], y[rows]


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


# --- jobs --------------------------------------------------------------------------------------
def zero2(comm, spec: dict) -> dict:
    """The student's ``ShardedAdamW`` trains the dense stack for ``steps`` steps."""
    zero = student()
    _LOG._keep = True
    blocks = make_blocks(spec)
    params = [p for b in blocks for p in b.parameters()]
    opt = zero.ShardedAdamW(params, StudentComm(comm), **ADAMW)
    sent, grads_left, after = [], 0, []
    for step in range(spec["steps"]):
        x, y = local(spec, comm.rank, step)
        for b in blocks:
            x = b(x)
        loss_of(x, y).backward()
        before = comm.stats.bytes_sent
        _LOG._step = step
        opt.step()
        _LOG._step = None
        sent.append(int(comm.stats.bytes_sent - before))
        grads_left += sum(p.grad is not None for p in params)
        after.append(torch.cat([p.detach().reshape(-1) for p in params]).to(torch.float64))
        opt.zero_grad()
    return {
        "params": [p.detach().clone() for p in params],
        "after": after,  # this rank's parameters after each step, flat
        "grads_left": int(grads_left),
        "calls": list(_LOG._calls),
        "bytes": sent,
    }


def zero3(comm, spec: dict) -> dict:
    """The student's ``ShardedStack`` (prefetch on) trains with torch's AdamW on its shards."""
    zero = student()
    census = Census()
    blocks = make_blocks(spec, census)
    stack = zero.ShardedStack(blocks, StudentComm(comm), prefetch=True)
    shards = list(stack.parameters())
    opt = torch.optim.AdamW(shards, foreach=False, **ADAMW)
    sent, between, after, first_grads = [], [], [], None
    for step in range(spec["steps"]):
        x, y = local(spec, comm.rank, step)
        before = comm.stats.bytes_sent
        _LOG._step = step
        out = stack(x)
        between.append(census.holding())
        loss_of(out, y).backward()
        _LOG._step = None
        after.append(census.holding())
        sent.append(int(comm.stats.bytes_sent - before))
        if step == 0:
            first_grads = [None if s.grad is None else s.grad.detach().clone() for s in shards]
        opt.step()
        opt.zero_grad()
    return {
        "shards": [s.detach().clone() for s in shards],
        "first_grads": first_grads,
        "census": list(census._events),
        "between": between,
        "after": after,
        "calls": list(_LOG._calls),
        "bytes": sent,
    }


def peak(comm, spec: dict) -> dict:
    """The measured job: two steps of the student's ``ShardedStack`` (prefetch off) and torch's
    AdamW under the profiler, from the import of the student's module on (what it allocates at
    import counts); returns the raw memory events."""
    _LOG._synchronous = True
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        zero = student()
        census = Census()
        blocks = make_blocks(spec, census, torch.float32)
        stack = zero.ShardedStack(blocks, StudentComm(comm), prefetch=False)
        del blocks
        shards = list(stack.parameters())
        opt = torch.optim.AdamW(shards, foreach=False, **ADAMW)
        batches = [local(spec, comm.rank, step, torch.float32) for step in range(spec["steps"])]
        with record_function("grader:steps"):
            for x, y in batches:
                loss_of(stack(x), y).backward()
                opt.step()
                opt.zero_grad()
    events, window = memory_events(prof)
    return {
        "shards": [s.detach().clone() for s in shards],
        "events": events,
        "window": window,
    }


def memory_events(prof) -> tuple[torch.Tensor, list[int]]:
    """(time ns, bytes, address) of every allocation (+) and free (-) the profiler saw, and the
    steps' window [start, end] in the same clock."""
    results = prof.profiler.kineto_results
    window = [-1, -1]
    for event in results.events():
        if event.name() == "grader:steps":
            window = [int(event.start_ns()), int(event.end_ns())]
    rows = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name == "[memory]":
            fields = node.extra_fields
            rows.append([int(node.start_time_ns), int(fields.alloc_size), int(fields.ptr)])
    rows.sort()
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3), window
