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

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
IN_PLACE = ("tree_broadcast", "ring_allreduce", "butterfly_allreduce")


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


def _stats_delta(after, before) -> dict:
    delta = after - before
    return {
        "bytes_sent": delta.bytes_sent,
        "messages_sent": delta.messages_sent,
        "bytes_received": delta.bytes_received,
        "messages_received": delta.messages_received,
    }


def run_cases(comm, function: str, cases: list[dict]) -> list[dict]:
    """Call ``collectives.<function>`` on each case; report what this rank holds and sent.

    Per case: ``result`` (the tensor after an in-place call, else the return value),
    ``input_after`` (the input after a call that must not modify it), ``stats`` (this rank's
    traffic during the call), and ``contiguous`` (the layout of the input after the call).
    """
    collectives = importlib.import_module("collectives")
    fn = getattr(collectives, function)
    reports = []
    for case in cases:
        x = make_input(case, comm.rank)
        before = comm.stats
        returned = fn(comm, x, case["src"]) if function == "tree_broadcast" else fn(comm, x)
        stats = _stats_delta(comm.stats, before)
        if function in IN_PLACE:
            reports.append({"result": x, "stats": stats})
        else:
            reports.append({"result": returned, "input_after": x, "stats": stats})
    return reports


def reduce_scatter_rejects(comm, shape: tuple[int, ...]) -> dict:
    """Call ring_reduce_scatter on a shape it must refuse; report the error and the traffic."""
    collectives = importlib.import_module("collectives")
    before = comm.stats
    error = None
    try:
        collectives.ring_reduce_scatter(comm, torch.ones(shape))
    except ValueError as raised:
        error = f"ValueError: {raised}"
    return {"error": error, "stats": _stats_delta(comm.stats, before)}
