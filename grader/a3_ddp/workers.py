"""What the hidden tests of assignment 3 run inside the worker processes, and their inputs.

The student's ``ddp`` is imported only here, inside the processes ``md.launch`` starts, never
in the pytest or grader process. Every job takes JSON arguments only (the grading sandbox
receives jobs as JSON) and builds its model and data from them: a *spec* dict (``make_model``,
``make_batch``). The trusted side (``reference.py``) builds the same models and data from the
same spec and trains them in one process. This module does not import pytest.

What a rank reports besides gradients and parameters, measured by the grader's code:

* every call of ``md.allreduce`` (``AllreduceLog``: the public function is wrapped before the
  student's module is imported), with the phase it came in (step, micro-step), the number of
  elements, ``async_op`` and the clock;
* when each parameter's gradient was final in each backward (``GradClock``: a hook registered
  before the student's, so it runs first), and when ``loss.backward()`` began and returned;
* the spans the student's code recorded into the recorder it was given (``SpanLog``, with the
  ``begin``/``end`` of ``minidist.trace.Recorder``).
"""

from __future__ import annotations

import functools
import importlib
import time

import torch
from torch import nn

import minidist as md

if __package__:  # under pytest: grader.a3_ddp.workers
    from .. import guard
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules

STUDENT_MODULE = "ddp"
DTYPE = torch.float64  # double precision: one process and p ranks differ by rounding only


# --- the grader's instruments ------------------------------------------------------------------
class AllreduceLog:
    """Wraps ``md.allreduce`` (under every public name) to log each call; ``phase`` tags them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.phase: list[int] | None = None
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        import minidist.collectives as collectives
        import minidist.collectives.api as api

        original = api.allreduce

        @functools.wraps(original)
        def allreduce(comm, tensor, *args, **kwargs):
            self.calls.append(
                {
                    "phase": self.phase,
                    "numel": int(tensor.numel()) if isinstance(tensor, torch.Tensor) else -1,
                    "async_op": bool(kwargs.get("async_op", args[2] if len(args) > 2 else False)),
                    "t_ns": time.perf_counter_ns(),
                }
            )
            return original(comm, tensor, *args, **kwargs)

        for owner in (md, collectives, api):
            owner.allreduce = allreduce


class GradClock:
    """A post-accumulate-grad hook per parameter that notes when its gradient was final."""

    def __init__(self, module: nn.Module) -> None:
        self.ready: list[list] = []  # [phase, name, t_ns]
        self.phase: list[int] | None = None
        for name, param in module.named_parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(functools.partial(self._note, name))

    def _note(self, name: str, param) -> None:
        self.ready.append([self.phase, name, time.perf_counter_ns()])


class SpanLog:
    """The recorder the student's DDP gets: ``begin(name, cat=..., **args) -> token``, ``end(token)``."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.phase: list[int] | None = None

    def begin(self, name: str, cat: str = "compute", **args) -> int:
        bytes_ = args.get("bytes")
        self.spans.append(
            {
                "phase": self.phase,
                "name": str(name),
                "cat": str(cat),
                "bytes": int(bytes_) if isinstance(bytes_, int) else -1,
                "begin_ns": time.perf_counter_ns(),
                "end_ns": None,
            }
        )
        return len(self.spans) - 1

    def end(self, token) -> None:
        if isinstance(token, int) and 0 <= token < len(self.spans) and self.spans[token]["end_ns"] is None:
            self.spans[token]["end_ns"] = time.perf_counter_ns()


_LOG = AllreduceLog()


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


KINDS = ("deep", "frozen", "unused", "tied", "mixed")


def make_model(spec: dict, rank: int = 0) -> nn.Module:
    """The spec's model in double precision; rank r > 0 starts from other weights (seed + r):
    DDP's first broadcast must make them rank 0's."""
    kind = spec["model"]
    torch.manual_seed(spec["seed"] + 7919 * rank)
    model = {
        "deep": lambda: Deep(),
        "frozen": lambda: Deep(frozen=True),
        "unused": lambda: Deep(spare=True),
        "tied": lambda: Tied(),
        "mixed": lambda: Tied(mixed=True),
    }[kind]()
    return model.to(DTYPE)


def make_batch(spec: dict, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step: ``ranks * local_batch`` rows, rank r's are rows
    ``[r * local_batch, (r + 1) * local_batch)``."""
    rows = spec["ranks"] * spec["local_batch"]
    g = torch.Generator().manual_seed(spec["seed"] * 1000 + 31 * step + micro)
    if spec["model"] in ("tied", "mixed"):
        tokens = torch.randint(0, 24, (rows, 5), generator=g)
        return tokens, torch.randint(0, 24, (rows, 5), generator=g)
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
    micro-batches (all but the last inside ``no_sync``); report what the grader checks."""
    ddp = student()
    model = make_model(spec, comm.rank)
    clock = GradClock(model)
    spans = SpanLog()
    wrapped = ddp.BucketedDDP(
        model,
        comm,
        bucket_mb=spec["bucket_mb"],
        find_unused_parameters=spec.get("find_unused", False),
        recorder=spans,
    )
    optimizer = optimizer_for(spec, model.parameters())
    first_grads, backward = None, []
    _LOG.calls.clear()
    for step in range(spec["steps"]):
        optimizer.zero_grad(set_to_none=True)
        for micro in range(spec.get("accumulate", 1)):
            phase = [step, micro]
            _LOG.phase = clock.phase = spans.phase = phase
            inputs, target = local_rows(spec, comm.rank, make_batch(spec, step, micro))
            last = micro == spec.get("accumulate", 1) - 1
            with wrapped.no_sync() if not last else _nothing():
                loss = loss_of(spec, wrapped(inputs), target)
                begin = time.perf_counter_ns()
                loss.backward()
                backward.append({"phase": phase, "begin_ns": begin, "end_ns": time.perf_counter_ns()})
        _LOG.phase = clock.phase = spans.phase = None
        if step == 0:
            first_grads = named_grads(model)
        optimizer.step()
    return {
        "grads": first_grads,
        "params": named_params(model),
        "buckets": [[str(name) for name in bucket] for bucket in wrapped.buckets],
        "calls": list(_LOG.calls),
        "ready": clock.ready,
        "spans": spans.spans,
        "backward": backward,
    }


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
