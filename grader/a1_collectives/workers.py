"""What the hidden tests run inside the worker processes, and the inputs they use.

Student code is imported only here, inside the processes ``md.launch`` starts: the pytest
process itself never imports ``collectives``, so a broken or hostile submission cannot
break collection or tamper with the test process' own modules. This module deliberately
does not import pytest (every rank imports it; pytest alone costs ~0.1 s per rank).

A *case* is a plain dict describing one call::

    {"shape": (4, 3), "dtype": "float32", "seed": 7, "layout": "contiguous", "src": 0}

``layout`` is "contiguous", "transposed" (2-D only: the transpose of a contiguous tensor)
or "strided" (every other element of a larger tensor along the last dimension).
"""

from __future__ import annotations

import importlib

import torch

if __package__:  # under pytest: grader.a1_collectives.workers
    from .. import guard, student_comm
    from . import rules
else:  # in the grading sandbox, where these files are copied side by side
    import guard
    import rules
    import student_comm

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
IN_PLACE = ("tree_broadcast", "ring_allreduce", "butterfly_allreduce", "fast_allreduce")


def make_input(case: dict, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input for ``case``: deterministic, different on every rank, in the case's layout."""
    shape, layout = tuple(case["shape"]), case.get("layout", "contiguous")
    dtype = DTYPES[case.get("dtype", "float32")]
    if layout == "transposed":
        if len(shape) != 2:
            raise ValueError(f"layout 'transposed' needs a 2-D shape, got {shape}")
        storage_shape = (shape[1], shape[0])
    elif layout == "strided":
        storage_shape = (*shape[:-1], 2 * shape[-1])
    elif layout == "contiguous":
        storage_shape = shape
    else:
        raise ValueError(f"unknown layout {layout!r}")
    generator = torch.Generator().manual_seed(100_003 * case["seed"] + rank)
    if dtype.is_floating_point:
        values = (torch.randn(storage_shape, generator=generator, dtype=torch.float64) * 10).to(dtype)
    else:
        values = torch.randint(-1000, 1000, storage_shape, generator=generator, dtype=dtype)
    if layout == "transposed":
        return values.t()
    if layout == "strided":
        return values[..., ::2]
    return values


def import_student(comm, record: bool = False) -> tuple:
    """Guard this process, then import ``collectives``; return it and the communicator it gets.

    The guard (``guard.py``) goes in first, so that the library's collectives are refused
    whatever way the student's module reaches them; the student's code sees a ``StudentComm``
    (point-to-point only, traffic counted per peer), never the launcher's communicator.
    """
    guard.install_rules(rules)
    return importlib.import_module("collectives"), student_comm.StudentComm(comm, record=record)


class Meter:
    """The traffic of one call: per peer (from the StudentComm) and in the library's own counters."""

    def __init__(self, comm, student) -> None:
        self.comm, self.student = comm, student
        self.traffic = student_comm.traffic(student)
        self.library = comm.stats

    def report(self) -> dict:
        after, library = student_comm.traffic(self.student), self.comm.stats - self.library
        report = {key: [a - b for a, b in zip(after[key], self.traffic[key])] for key in after}
        report["library_bytes"] = [library.bytes_sent, library.bytes_received]
        return report


def run_cases(comm, function: str, cases: list[dict]) -> list[dict]:
    """Call ``collectives.<function>`` on each case; report what this rank holds and sent.

    Per case: ``result`` (the tensor after an in-place call, else the return value),
    ``input_after`` (the input after a call that must not modify it), ``traffic`` (this
    rank's messages and bytes to and from every rank during the call, see ``Meter``) and
    ``transcript`` (every message in order, with a copy of what was sent: ``student_comm.Transcript``).
    """
    collectives, student = import_student(comm, record=True)
    fn = getattr(collectives, function)
    reports = []
    for case in cases:
        x = make_input(case, comm.rank)
        meter = Meter(comm, student)
        student_comm.transcript(student)  # nothing before the call counts
        returned = fn(student, x, case["src"]) if function == "tree_broadcast" else fn(student, x)
        traffic, transcript = meter.report(), student_comm.transcript(student)
        if function in IN_PLACE:
            reports.append({"result": x, "traffic": traffic, "transcript": transcript})
        else:
            reports.append(
                {"result": returned, "input_after": x, "traffic": traffic, "transcript": transcript}
            )
    return reports


def reduce_scatter_rejects(comm, shape: tuple[int, ...]) -> dict:
    """Call ring_reduce_scatter on a shape it must refuse; report the error and the traffic."""
    collectives, student = import_student(comm)
    meter = Meter(comm, student)
    error = None
    try:
        collectives.ring_reduce_scatter(student, torch.ones(shape))
    except ValueError as raised:
        error = f"ValueError: {raised}"
    return {"error": error, "traffic": meter.report()}
