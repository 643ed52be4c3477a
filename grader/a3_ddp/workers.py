"""What the hidden tests of assignment 3 run inside the worker processes, and their inputs.

The student's ``ddp`` is imported only here, inside the processes ``md.launch`` starts, never
in the pytest or grader process. Every job takes JSON arguments only (the grading sandbox
receives jobs as JSON) and builds its model and data from them: a *spec* dict (``make_model``,
``make_batch``). The trusted side (``reference.py``) builds the same models and data from the
same spec and trains them in one process. This module does not import pytest.

What a rank reports besides gradients and parameters, measured by the grader's code:

* every call of a library collective (``CollectiveLog``: ``md.allreduce``, ``md.broadcast``,
  ``md.reduce``, ... are wrapped before the student's module is imported) once the DDP is
  built, with the phase it came in (step, micro-step), the number of elements, ``async_op``,
  the algorithm and the clock -- and, for an allreduce, a copy of what it carries, taken when
  it is called;
* the parameters at the start of every step (the trusted side computes from them each rank's
  local gradients, which every allreduce must carry);
* the messages the student's code sent itself on the communicator it was given (a
  ``StudentComm``: point-to-point only, counted), and the bytes and messages the transport
  sent during training (``comm.stats`` of the launcher's communicator, which the student's
  code never gets);
* when each parameter's gradient was final in each backward (``GradClock``: a hook registered
  before the student's, so it runs first), and when ``loss.backward()`` began and returned;
* the spans the student's code recorded into the recorder it was given (``SpanLog``, with the
  ``begin``/``end`` of ``minidist.trace.Recorder``);
* when the backward pass ended, by a callback the grader's first hook queues (before the
  student's, so it runs first).

Every record carries a sequence number (``seq``, one counter for the three instruments): the
grader's hooks, the student's hooks and the allreduce calls run on one thread, so the order of
the numbers is the order of the events, whatever the clock says.

Forgery the worker rules out. The clock, the collectives it wraps, the tensor functions the log
copies with and the hook registration are bound here, when this module is imported -- before the
student's module is: a submission that replaces ``time.perf_counter_ns`` or
``torch.Tensor.register_post_accumulate_grad_hook`` changes nothing the grader measures. The log
copies only a plain ``torch.Tensor`` (a subclass could answer the copy with other data). The
instruments keep their state private (``_calls``, ``_phase``, ``_given``: the intake check
refuses private attributes of objects not the submission's own), each record holds its own copy
of the phase, the student's DDP gets a recorder with ``begin`` and ``end`` only
(``SpanLog.recorder()``), never the log itself, and a ``StudentComm``, never the transport's
communicator (``_comm``, refused at intake as well).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
from time import perf_counter_ns as _now  # bound before the student's module is imported

import torch
from torch import nn

from minidist.clock import TimedLayer

if __package__:  # under pytest: grader.a3_ddp.workers
    from .. import guard
    from ..instruments import wrap_collectives
    from ..seeding import seeded_
    from ..student_comm import StudentComm, traffic
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    from instruments import wrap_collectives
    from seeding import seeded_
    from student_comm import StudentComm, traffic

#: bound now, before the student's module is imported (which might replace them)
_register_hook = torch.Tensor.register_post_accumulate_grad_hook
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_SEQ = itertools.count()  # one order for every event of a rank
_IS_TENSOR = torch.is_tensor
_NUMEL = torch.Tensor.numel
_ELEMENT_SIZE = torch.Tensor.element_size
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_RESHAPE = torch.Tensor.reshape
_CAT = torch.cat

STUDENT_MODULE = "ddp"
DTYPE = torch.float64  # double precision: one process and p ranks differ by rounding only


# --- the grader's instruments ------------------------------------------------------------------
#: every collective of the library: each is logged; DDP may use ``allreduce`` in backward only
#: (``broadcast`` in its constructor, before the log starts)
COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "barrier")


class CollectiveLog:
    """Wraps the library's collectives (under every public name) to log each call; ``phase`` tags them.

    An allreduce's record holds a copy of what it carries, taken in the caller's thread at the
    call (before the communication thread can touch it): the trusted side checks that it is
    this rank's gradient of one bucket. The student's DDP gets a ``StudentComm`` (point-to-point
    only, its messages counted); a wrapped collective called on it runs on the communicator it
    wraps, so the library's collectives take their usual path (the shm transport's workspace
    included) and only the student's own messages show in the ``StudentComm``'s counters.
    """

    def __init__(self) -> None:
        self._calls: list[dict] = []
        self._waits: list[list] = []  # [phase, seq of the call waited for, seq]: the handle's wait()
        self._phase: tuple[int, int] | None = None
        self._given = None  # the StudentComm the DDP was given
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True
        wrap_collectives(COLLECTIVES, self._wrap)

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(comm, *args, **kwargs):
            try:  # the arguments as the collective sees them, defaults included
                bound = signature.bind(comm, *args, **kwargs)
                bound.apply_defaults()
                arguments = dict(bound.arguments)
            except TypeError:  # the call itself is wrong: the collective raises below
                arguments = {}
            tensor = arguments.get("tensor")
            is_tensor = _IS_TENSOR(tensor)
            plain = type(tensor) is torch.Tensor  # a subclass could answer clone() with other data
            record = {
                "function": name,
                "phase": _copy(self._phase),
                "numel": int(_NUMEL(tensor)) if is_tensor else -1,
                "itemsize": int(_ELEMENT_SIZE(tensor)) if is_tensor else -1,
                "async_op": bool(arguments.get("async_op", False)),
                "algorithm": str(arguments.get("algorithm", "")),
                "given_comm": comm is self._given and self._given is not None,
                "t_ns": _now(),
                "seq": next(_SEQ),
            }
            if name == "allreduce":
                record["carried"] = _RESHAPE(_CLONE(_DETACH(tensor)), -1) if plain else None
            self._calls.append(record)
            if isinstance(comm, StudentComm):  # run on the transport: its own path, its own bytes
                comm = comm._comm
            result = original(comm, *args, **kwargs)
            if name == "allreduce" and record["async_op"] and result is not None:
                return _tracked(result, record["seq"], self._waits, lambda: _copy(self._phase))
            return result

        return collective


class Work:
    """The handle an asynchronous allreduce returns to the student's code: the library's handle
    behind ``wait``, ``is_completed`` and ``add_done_callback`` (functions in slots, no way to
    the log), which notes each ``wait()`` and each ``is_completed()`` that answered True: from
    then on the training thread has waited for the allreduce (the emulated clock of the measured
    test makes it wait as long)."""

    __slots__ = ("wait", "is_completed", "add_done_callback")

    def __init__(self, wait, is_completed, add_done_callback) -> None:
        self.wait, self.is_completed, self.add_done_callback = wait, is_completed, add_done_callback


def _tracked(handle, call_seq: int, waits: list, phase) -> Work:
    def wait(timeout=None):
        waits.append([phase(), call_seq, next(_SEQ)])
        return handle.wait(timeout)

    def is_completed():
        done = bool(handle.is_completed())
        if done:
            waits.append([phase(), call_seq, next(_SEQ)])
        return done

    def add_done_callback(callback):
        return handle.add_done_callback(lambda _handle: callback(work))

    work = Work(wait, is_completed, add_done_callback)
    return work


def _copy(phase: tuple[int, int] | None) -> list[int] | None:
    """The phase as a new list: a record never shares an object with anything else."""
    return None if phase is None else [int(phase[0]), int(phase[1])]


class GradClock:
    """A post-accumulate-grad hook per parameter that notes when its gradient was final, and
    (queued by the first of them in each backward) a callback that notes when backward ended."""

    def __init__(self, module: nn.Module) -> None:
        self._ready: list[list] = []  # [phase, name, t_ns, seq]
        self._ends: list[list] = []  # [phase, seq]: the grader's end-of-backward callback
        self._phase: tuple[int, int] | None = None
        self._queued = False
        for name, param in module.named_parameters():
            if param.requires_grad:
                _register_hook(param, functools.partial(self._note, name))

    def _note(self, name: str, param) -> None:
        self._ready.append([_copy(self._phase), name, _now(), next(_SEQ)])
        if not self._queued:
            self._queued = True
            _queue_callback(self._end)

    def _end(self) -> None:
        self._queued = False
        self._ends.append([_copy(self._phase), next(_SEQ)])


class SpanLog:
    """The spans the student's DDP records through ``recorder()``: ``begin(name, cat=...,
    **args) -> token`` and ``end(token)``, as ``minidist.trace.Recorder`` has them."""

    def __init__(self) -> None:
        self._spans: list[dict] = []
        self._phase: tuple[int, int] | None = None

    def _begin(self, name: str, cat: str = "compute", **args) -> int:
        bytes_ = args.get("bytes")
        self._spans.append(
            {
                "phase": _copy(self._phase),
                "name": str(name),
                "cat": str(cat),
                "bytes": int(bytes_) if isinstance(bytes_, int) else -1,
                "begin_ns": _now(),
                "end_ns": None,
            }
        )
        return len(self._spans) - 1

    def _end(self, token) -> None:
        spans = self._spans
        if isinstance(token, int) and 0 <= token < len(spans) and spans[token]["end_ns"] is None:
            spans[token]["end_ns"] = _now()

    def recorder(self) -> Recorder:
        """What the student's DDP gets: ``begin`` and ``end``, and no way to the log."""
        return Recorder(self._begin, self._end)


class Recorder:
    """``begin(name, cat=..., **args) -> token`` and ``end(token)``, nothing else (no
    ``__dict__``: the two functions are slots)."""

    __slots__ = ("begin", "end")

    def __init__(self, begin, end) -> None:
        self.begin, self.end = begin, end


_LOG = CollectiveLog()


def student():
    """The student's module, imported after the guard refuses the DDPs and allreduce is logged."""
    guard.install_rules(rules)
    _LOG.install()
    return importlib.import_module(STUDENT_MODULE)


# --- models ------------------------------------------------------------------------------------
class Deep(nn.Module):
    """x (8) -> 32 -> 32 -> 32 -> 4, tanh between; ``frozen``: the first layer does not train
    and a LayerNorm follows it; ``spare``: a layer registered in the middle, never called."""

    def __init__(self, frozen: bool = False, spare: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32) if frozen else None
        self.mid = nn.Linear(32, 32)
        if spare:
            self.spare = nn.Linear(32, 24)
        self.top = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        if frozen:
            self.inp.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.norm is not None:
            h = self.norm(h)
        return self.out(torch.tanh(self.top(torch.tanh(self.mid(h)))))


class Tied(nn.Module):
    """Tokens -> embedding (V x 16) -> 16 -> 16 -> logits through the *same* embedding matrix;
    ``mixed``: also a frozen projection and a layer never called."""

    def __init__(self, vocab: int = 24, mixed: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.proj = nn.Linear(16, 16, bias=False)
        if mixed:
            self.unused = nn.Linear(16, 40)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two names
        if mixed:
            self.proj.requires_grad_(False)
        else:
            self.proj = None

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.proj is not None:
            h = h + self.proj(h)
        return self.head(torch.tanh(self.hidden(h)))


class Timed(nn.Module):
    """The measured test's model: ``TimedLayer``s (``minidist.clock``) of a small transformer's
    parameter tensors (``timed_layout``) in registration order, in float32. Their forward and
    backward do not wait here: the trusted side times the step on the emulated clock from the
    order of events the grader noted. The output is the input; each weight's gradient is one
    number repeated (the mean of the output's gradient), real tensors that DDP must send."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TimedLayer(numel, 0.0, 0.0) for _, numel, _ in timed_layout())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


#: the measured test's model and cluster: a 12-block transformer of width 64 (147 tensors,
#: 620,352 parameters, 2.48 MB of float32 gradients) on 524,288 tokens per GPU and step, a V100
#: at 40% of its peak (50 TFLOP/s): forward 12.5 ms, backward 24.9 ms; a 1 Gbit/s link with
#: alpha = 50 us per message: one ring allreduce of the gradient on 2 ranks takes 20.0 ms
TIMED = {"blocks": 12, "width": 64, "vocab": 256, "tokens": 524_288, "flops_per_s": 50e12}
LINK_1G = {"alpha_s": 50e-6, "bandwidth_Bps": 125e6}


def timed_layout() -> list[tuple[str, int, float]]:
    """(name, elements, forward FLOPs) of the measured model's parameter tensors, in
    registration order: an input embedding (a lookup: no FLOPs), blocks of attention and MLP
    matrices (2 N T forward FLOPs for N entries, T tokens) with their biases and LayerNorms
    (none), and an output matrix and bias. Backward takes twice the forward's FLOPs."""
    d, tokens = TIMED["width"], TIMED["tokens"]
    shapes = [("embed", TIMED["vocab"] * d, False)]
    for b in range(TIMED["blocks"]):
        shapes += [
            (f"block{b}.qkv.w", 3 * d * d, True),
            (f"block{b}.qkv.b", 3 * d, False),
            (f"block{b}.proj.w", d * d, True),
            (f"block{b}.proj.b", d, False),
            (f"block{b}.ln1.w", d, False),
            (f"block{b}.ln1.b", d, False),
            (f"block{b}.up.w", 4 * d * d, True),
            (f"block{b}.up.b", 4 * d, False),
            (f"block{b}.down.w", 4 * d * d, True),
            (f"block{b}.down.b", d, False),
            (f"block{b}.ln2.w", d, False),
            (f"block{b}.ln2.b", d, False),
        ]
    shapes += [("out.w", d * d, True), ("out.b", d, False)]
    return [(name, numel, 2.0 * numel * tokens if matrix else 0.0) for name, numel, matrix in shapes]


def timed_seconds() -> tuple[float, dict[str, float]]:
    """The measured model's forward seconds, and each parameter's backward seconds by its name
    in the model (``layers.<i>.weight``), on the emulated GPU."""
    rate = TIMED["flops_per_s"]
    layout = timed_layout()
    forward = sum(flops for _, _, flops in layout) / rate
    return forward, {f"layers.{i}.weight": 2 * flops / rate for i, (_, _, flops) in enumerate(layout)}


KINDS = ("deep", "frozen", "unused", "tied", "mixed", "timed")


def make_model(spec: dict, rank: int = 0) -> nn.Module:
    """The spec's model in double precision; rank r > 0 starts from other weights (seed + r):
    DDP's first broadcast must make them rank 0's."""
    kind = spec["model"]
    model = {
        "deep": lambda: Deep(),
        "frozen": lambda: Deep(frozen=True),
        "unused": lambda: Deep(spare=True),
        "tied": lambda: Tied(),
        "mixed": lambda: Tied(mixed=True),
        "timed": Timed,
    }[kind]()
    if kind == "timed":  # float32, as a GPU's gradients; zeros (its gradients do not depend on them)
        return model
    return seeded_(model.to(DTYPE), spec["seed"] + 7919 * rank)


def make_batch(spec: dict, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step: ``ranks * local_batch`` rows, rank r's are rows
    ``[r * local_batch, (r + 1) * local_batch)``."""
    rows = spec["ranks"] * spec["local_batch"]
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + 31 * step + micro)
    if spec["model"] in ("tied", "mixed"):
        tokens = torch.randint(0, 24, (rows, 5), generator=g)
        return tokens, torch.randint(0, 24, (rows, 5), generator=g)
    if spec["model"] == "timed":
        return torch.randn(rows, 4, generator=g), torch.randn(rows, 4, generator=g)
    return torch.randn(rows, 8, generator=g, dtype=DTYPE), torch.randn(rows, 4, generator=g, dtype=DTYPE)


def loss_of(spec: dict, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if spec["model"] in ("tied", "mixed"):
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(output, target)


def optimizer_for(spec: dict, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.get("lr", 0.01), weight_decay=0.01)


def local_rows(spec: dict, rank: int, batch: tuple[torch.Tensor, torch.Tensor]):
    lo = rank * spec["local_batch"]
    return tuple(t[lo : lo + spec["local_batch"]] for t in batch)


def named_grads(module: nn.Module) -> dict:
    return {
        name: (None if p.grad is None else p.grad.detach().clone()) for name, p in module.named_parameters()
    }


def named_params(module: nn.Module) -> dict:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


# --- jobs --------------------------------------------------------------------------------------
def train(comm, spec: dict) -> dict:
    """The student's DDP trains the spec's model for ``steps`` AdamW steps of ``accumulate``
    micro-batches (all but the last inside ``no_sync``); report what the grader checks.

    The DDP gets a ``StudentComm`` over ``comm`` (point-to-point only, counted); the log of
    collectives starts once its constructor returns (the constructor's broadcast is not
    logged), and so does the count of the transport's own traffic (``comm.stats``): during
    training, everything the transport sends must be the logged allreduces'."""
    ddp = student()
    model = make_model(spec, comm.rank)
    clock = GradClock(model)
    spans = SpanLog()
    given = _LOG._given = StudentComm(comm)
    wrapped = ddp.BucketedDDP(
        model,
        given,
        bucket_mb=spec["bucket_mb"],
        find_unused_parameters=spec.get("find_unused", False),
        recorder=spans.recorder(),
    )
    optimizer = optimizer_for(spec, model.parameters())
    first_grads, backward, start_params = None, [], []
    _LOG._calls.clear()
    _LOG._waits.clear()
    stats_before, messages_before = comm.stats.copy(), traffic(given)
    for step in range(spec["steps"]):
        start_params.append(flat_params(model))  # the trusted side computes the local gradients
        optimizer.zero_grad(set_to_none=True)
        for micro in range(spec.get("accumulate", 1)):
            phase = (step, micro)  # a tuple: nobody can change it; every record copies it
            _LOG._phase = clock._phase = spans._phase = phase
            inputs, target = local_rows(spec, comm.rank, make_batch(spec, step, micro))
            last = micro == spec.get("accumulate", 1) - 1
            with wrapped.no_sync() if not last else _nothing():
                loss = loss_of(spec, wrapped(inputs), target)
                begin = _now()
                loss.backward()
                backward.append({"phase": _copy(phase), "begin_ns": begin, "end_ns": _now()})
        _LOG._phase = clock._phase = spans._phase = None
        if step == 0:
            first_grads = named_grads(model)
        optimizer.step()
    transport = comm.stats - stats_before
    messages_after = traffic(given)
    return {
        "grads": first_grads,
        "params": named_params(model),
        "start_params": start_params,
        "buckets": [[str(name) for name in bucket] for bucket in wrapped.buckets],
        "calls": list(_LOG._calls),
        "waits": list(_LOG._waits),
        "bucket_mb": float(spec["bucket_mb"]),
        "ready": clock._ready,
        "ends": clock._ends,
        "spans": spans._spans,
        "backward": backward,
        "transport": {"bytes_sent": int(transport.bytes_sent), "messages_sent": int(transport.messages_sent)},
        "point_to_point": {
            key: sum(messages_after[key]) - sum(messages_before[key])
            for key in ("sent_messages", "sent_bytes", "received_messages", "received_bytes")
        },
    }


def tuned(comm, spec: dict) -> dict:
    """The measured test: the student's ``tuned_bucket_mb`` picks the cap for the timed model
    on the 1 Gbit/s link (it gets a copy of the parameters: its own model to look at), then
    ``train`` runs the student's DDP with that cap; the trusted side times the step."""
    ddp = student()
    forward, backward = timed_seconds()
    cap = ddp.tuned_bucket_mb(
        list(make_model(spec).named_parameters()),
        forward,
        dict(backward),
        LINK_1G["alpha_s"],
        LINK_1G["bandwidth_Bps"],
        comm.world_size,
    )
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0 or cap == float("inf"):
        raise ValueError(f"tuned_bucket_mb returned {cap!r}: a cap in MiB, >= 0 and finite, is expected")
    return train(comm, {**spec, "bucket_mb": float(cap)})


def flat_params(module: nn.Module) -> torch.Tensor:
    """Every parameter (``named_parameters()`` order), flattened into one tensor."""
    return _CAT([_RESHAPE(_CLONE(_DETACH(p)), -1) for _, p in module.named_parameters()])


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def bucket_cases(comm, cases: list[dict]) -> list:
    """``assign_buckets`` on each case: parameters of the given shapes, some frozen, some tied."""
    ddp = student()
    return [ddp.assign_buckets(case_parameters(case), case["bucket_mb"]) for case in cases]


def case_parameters(case: dict) -> list[tuple[str, nn.Parameter]]:
    """``case["params"]``: ``[name, shape, frozen, dtype]``, or ``[name, "=", other name]`` for a
    second name of an earlier parameter (tied)."""
    made: dict[str, nn.Parameter] = {}
    out = []
    for entry in case["params"]:
        if entry[1] == "=":
            out.append((entry[0], made[entry[2]]))
            continue
        name, shape, frozen, dtype = entry
        param = nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)), requires_grad=not frozen)
        made[name] = param
        out.append((name, param))
    return out
