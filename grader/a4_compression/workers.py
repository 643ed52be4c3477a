"""What the hidden tests of assignment 4 run inside the worker processes, and their inputs.

The student's ``dgc`` is imported only here, inside the processes ``md.launch`` starts, never
in the pytest or grader process. Every job takes JSON arguments only and builds its data from
them (``vector``, ``gradient_sequence``, ``make_model``, ``make_data``); the trusted side
(``reference.py``) builds the same data from the same arguments. This module does not import
pytest.

What a training rank reports besides its parameters and loss, measured by the grader's code:

* every call of the library's collectives (``CollectiveLog``: ``md.allgather``,
  ``md.allreduce``, ... are wrapped before the student's module is imported), with the step it
  came in, the function, the number of bytes and ``async_op``; for an allgather also a copy of
  the payload, and it is that copy the transport carries (a payload changed after the launch
  changes nothing), so the log holds exactly what every rank received;
* every call of the student's hook, as the library's DDP makes it (bucket index, elements);
* what SGD applied: every bucket's buffer once backward is over (DDP has copied the hook's
  result into it; the parameters' ``.grad`` are views of it), and where in those buffers each
  parameter's gradient lies;
* the bytes the transport itself sent during each backward (``comm.stats``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math

import torch
from torch import nn

import minidist as md

if __package__:  # under pytest: grader.a4_compression.workers
    from .. import guard
    from ..instruments import wrap_collectives
    from ..seeding import seeded_
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    from instruments import wrap_collectives
    from seeding import seeded_

STUDENT_MODULE = "dgc"
COLLECTIVES = ("allgather", "allreduce", "broadcast", "reduce", "reduce_scatter")

# What the instruments and the reports rely on, bound now: this module is imported before the
# student's, so a submission that reassigns one of these later does not change what we measure.
# (The final loss of a training run is not trusted anyway: the grader recomputes it from the
# reported parameters, in its own process.)
_CROSS_ENTROPY = nn.functional.cross_entropy
_NUMEL = torch.Tensor.numel
_ELEMENT_SIZE = torch.Tensor.element_size
_EQUAL = torch.equal
_CLONE = torch.Tensor.clone
_DETACH = torch.Tensor.detach
_IS_TENSOR = torch.is_tensor
_CAT = torch.cat
_RESHAPE = torch.Tensor.reshape
_STORAGE = torch.Tensor.untyped_storage
_STORAGE_OFFSET = torch.Tensor.storage_offset
_STORAGE_POINTER = torch.UntypedStorage.data_ptr
_INT32 = torch.int32


# --- the grader's instruments ------------------------------------------------------------------
class CollectiveLog:
    """Wraps the library's collectives (under every public name) to log each call; ``phase`` tags them."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.phase: int | None = None
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        self.installed = True
        wrap_collectives(COLLECTIVES, self._wrap)

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def collective(comm, tensor, *args, **kwargs):
            is_tensor = _IS_TENSOR(tensor)
            try:  # async_op given by keyword or by position, or left to its default
                bound = signature.bind(comm, tensor, *args, **kwargs)
                bound.apply_defaults()
                async_op = bool(bound.arguments.get("async_op", False))
            except TypeError:  # the call itself is wrong: the collective raises below
                async_op = False
            record = {
                "phase": self.phase,
                "function": name,
                "bytes": int(_NUMEL(tensor) * _ELEMENT_SIZE(tensor)) if is_tensor else -1,
                "async_op": async_op,
            }
            self.calls.append(record)
            if name == "allgather" and is_tensor:  # the allgather reads its input, never writes it
                tensor = record["payload"] = _CLONE(_DETACH(tensor))  # what is logged is what is sent
            return original(comm, tensor, *args, **kwargs)

        return collective


_LOG = CollectiveLog()


def student():
    """The student's module, imported after the guard refuses the library's compressor."""
    guard.install_rules(rules)
    _LOG.install()
    return importlib.import_module(STUDENT_MODULE)


def config_of(dgc, spec: dict):
    """The student's ``DGCConfig`` of a JSON dict (lists become tuples)."""
    fields = {key: tuple(value) if isinstance(value, list) else value for key, value in spec.items()}
    return dgc.DGCConfig(**fields)


# --- data --------------------------------------------------------------------------------------
def vector(case: dict) -> torch.Tensor:
    """A test vector: ``n`` normal entries (float64) from ``data_seed``; ``ties``: rounded to
    quarters, so many magnitudes are equal; ``zeros``: that share of entries is 0."""
    g = torch.Generator().manual_seed(case["data_seed"])
    values = torch.randn(case["n"], generator=g, dtype=torch.float64)
    if case.get("ties"):
        values = torch.round(values * 4) / 4
    if case.get("zeros"):
        values[torch.rand(case["n"], generator=g) < case["zeros"]] = 0.0
    return values


def gradient_sequence(spec: dict) -> list[torch.Tensor]:
    """``steps`` float64 gradients of ``n`` entries; their scale varies (clipping acts on some)."""
    g = torch.Generator().manual_seed(spec["data_seed"])
    out = []
    for step in range(spec["steps"]):
        scale = 0.5 + 3.0 * torch.rand((), generator=g, dtype=torch.float64)
        out.append(scale * torch.randn(spec["n"], generator=g, dtype=torch.float64) / spec["n"] ** 0.5)
        if step % 3 == 2:  # a sparse gradient now and then: many entries exactly 0
            out[-1][torch.rand(spec["n"], generator=g) < 0.5] = 0.0
    return out


class MLP(nn.Module):
    """features -> hidden -> hidden -> classes, tanh between (float32)."""

    def __init__(self, features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(features, hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def make_model(spec: dict) -> nn.Module:
    return seeded_(MLP(spec["features"], spec["hidden"], spec["classes"]), spec["seed"])


def make_data(spec: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A classification problem a teacher network labels: ``rows`` x ``features``, float32."""
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    x = torch.randn(spec["rows"], spec["features"], generator=g)
    teacher = torch.randn(spec["features"], spec["classes"], generator=g)
    return x, (x @ teacher + 0.3 * torch.randn(spec["rows"], spec["classes"], generator=g)).argmax(1)


def batch_rows(spec: dict, step: int, rank: int) -> slice:
    """Rank ``rank``'s rows of ``step``: the global batch is ``ranks * local_batch`` rows,
    going round the data set; rank r has the r-th block of ``local_batch``."""
    per_step = spec["ranks"] * spec["local_batch"]
    start = (step * per_step) % spec["rows"] + rank * spec["local_batch"]
    return slice(start, start + spec["local_batch"])


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _CROSS_ENTROPY(model(x), y)


def where_gradients_lie(model: nn.Module, buffers: list[torch.Tensor]) -> list[list[int] | None]:
    """For each parameter (``named_parameters`` order), ``[j, offset]``: its ``.grad`` is a view
    of ``buffers[j]`` (the bucket the j-th hook call of this step got) from ``offset`` on;
    None if it is no contiguous view of one of them."""
    places = []
    for _, p in model.named_parameters():
        grad, place = p.grad, None
        if grad is not None and grad.is_contiguous():
            for j, buffer in enumerate(buffers):
                if _STORAGE_POINTER(_STORAGE(grad)) == _STORAGE_POINTER(_STORAGE(buffer)):
                    place = [j, int(_STORAGE_OFFSET(grad) - _STORAGE_OFFSET(buffer))]
        places.append(place)
    return places


def _payload_log(calls: list[dict]) -> tuple[list[dict], torch.Tensor]:
    """The collective log as data: each allgather's payload, if int32, moved into one flat
    tensor (``"payload": [offset, numel]`` into it); another dtype is named (``"dtype"``)."""
    records, payloads, at = [], [], 0
    for call in calls:
        record = dict(call)
        payload = record.pop("payload", None)
        if payload is not None and payload.dtype == _INT32:
            flat = _RESHAPE(payload, (-1,))
            record["payload"] = [at, int(_NUMEL(flat))]
            payloads.append(flat)
            at += int(_NUMEL(flat))
        elif payload is not None:
            record["dtype"] = str(payload.dtype)
        records.append(record)
    return records, _CAT(payloads) if payloads else torch.zeros(0, dtype=_INT32)


# --- jobs --------------------------------------------------------------------------------------
def schedule(comm, cases: list[dict]) -> list[list[float]]:
    """``sparsity_at`` of each case's steps."""
    dgc = student()
    return [[float(dgc.sparsity_at(step, config_of(dgc, c["config"]))) for step in c["steps"]] for c in cases]


def clip(comm, cases: list[dict]) -> list[dict]:
    """``clip_local`` of each case's vector; the input is reported too (it must not change)."""
    dgc = student()
    out = []
    for case in cases:
        grad = vector(case) * case["scale"]
        clipped = dgc.clip_local(grad, case["clip_norm"], case["world_size"])
        out.append({"clipped": clipped, "input": grad, "same_object": clipped is grad})
    return out


def select(comm, cases: list[dict]) -> list[torch.Tensor]:
    """``select_indices`` of each case's vector, with a generator seeded ``sample_seed``."""
    dgc = student()
    out = []
    for case in cases:
        generator = torch.Generator().manual_seed(case["sample_seed"])
        indices = dgc.select_indices(vector(case), case["k"], config_of(dgc, case["config"]), generator)
        out.append(indices)
    return out


def sequence(comm, spec: dict) -> dict:
    """``compress_step`` on a fixed gradient sequence; every step's (indices, values) and the end state."""
    dgc = student()
    config = config_of(dgc, spec["config"])
    grads = gradient_sequence(spec)
    state = dgc.DGCState.zeros_like(grads[0])
    generator = torch.Generator().manual_seed(spec["sample_seed"])
    steps = []
    for grad in grads:
        before = _CLONE(grad)
        indices, values = dgc.compress_step(state, grad, config, spec["world_size"], generator)
        steps.append({"indices": indices, "values": values, "grad_unchanged": bool(_EQUAL(before, grad))})
    return {
        "steps": steps,
        "velocity": state.velocity,
        "accumulated": state.accumulated,
        "step": int(state.step),
    }


def train(comm, spec: dict) -> dict:
    """The library's DDP with the student's hook trains ``make_model`` with SGD (no momentum)
    for ``steps`` steps; report the parameters, the collectives (with the allgathers'
    payloads), the bytes (each backward's, and the whole loop's), and what SGD applied: every
    hook call's bucket once backward is over, in call order, in one flat tensor (``applied``),
    and each step's ``where_gradients_lie`` (not for ``measured``: there the hook is the
    student's ``measured_hook()`` and the trusted side replays the update from the payloads).
    (The loss reported is for information only: the grader recomputes it from the parameters.)"""
    dgc = student()
    model = make_model(spec)
    x, y = make_data(spec)
    # the measured test trains with the hook the student chose (any configuration or design)
    hook = dgc.measured_hook() if spec.get("measured") else dgc.DGCHook(config_of(dgc, spec["config"]))
    record = not spec.get("measured")  # the measured run is long: its update is replayed from the payloads
    hook_calls: list[list[int]] = []
    buffers: list[torch.Tensor] = []  # this step's buckets, in hook call order
    phase = {"step": None}

    def instrumented(comm_, flat_grad, bucket_index):
        hook_calls.append([phase["step"], int(bucket_index), int(_NUMEL(flat_grad))])
        buffers.append(flat_grad)
        return hook(comm_, flat_grad, bucket_index)

    wrapped = md.DistributedDataParallel(model, comm, bucket_mb=spec["bucket_mb"], comm_hook=instrumented)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"])
    _LOG.calls.clear()
    sent, applied, places = [], [], []
    start = comm.stats.copy()
    for step in range(spec["steps"]):
        rows = batch_rows(spec, step, comm.rank)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(wrapped, x[rows], y[rows])
        phase["step"] = _LOG.phase = step
        before = comm.stats.copy()
        buffers.clear()
        loss.backward()
        sent.append(int((comm.stats - before).bytes_sent))
        phase["step"] = _LOG.phase = None
        # what SGD subtracts (the student's code is done with this step, but for a thread of
        # its own: the trusted side replays SGD from these and compares the final parameters)
        if record:
            applied.extend(_CLONE(_DETACH(buffer)) for buffer in buffers)
            places.append(where_gradients_lie(model, buffers))
        optimizer.step()
    sent_in_training = int((comm.stats - start).bytes_sent)
    with torch.no_grad():
        final = float(loss_of(model, x, y))
    calls, payloads = _payload_log(_LOG.calls)
    return {
        "params": {name: _CLONE(_DETACH(p)) for name, p in model.named_parameters()},
        "loss": final if math.isfinite(final) else None,
        "calls": calls,
        "payloads": payloads,
        "hooks": hook_calls,
        "applied": _CAT(applied) if applied else torch.zeros(0),
        "places": places,
        "sent": sent,
        "sent_in_training": sent_in_training,
    }
