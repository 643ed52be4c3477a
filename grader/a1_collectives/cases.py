"""The case table of assignment 1 (collectives): every hidden test, its points, its job and check.

Each case runs ``workers.run_cases`` (or ``workers.reduce_scatter_rejects``) on ``world_size``
ranks with a list of inputs, described as JSON; its check (``reference.py``) compares every
rank's result with a one-process reference and, for the budget tests, every rank's bytes,
messages and message schedule with what the named algorithm sends. ``seed`` (0 under pytest, a
secret one per student in the grader) is added to every input's seed.
"""

from __future__ import annotations

from collections.abc import Callable

from grader.assignment import Case
from grader.tiers import Tiers

from . import reference as ref
from . import timing
from .reference import ALL_WORLD_SIZES, TASKS

__all__ = ["TASKS", "cases"]


def _seeded(inputs: list[dict], seed: int) -> list[dict]:
    """The inputs with seeds only this run knows (``seed`` is derived from a key the student never sees)."""
    return [{**case, "seed": seed * 1000 + case.get("seed", 0)} for case in inputs]


def _values(
    name: str,
    points: float,
    function: str,
    world_size: int,
    inputs: list[dict],
    seed: int,
    transport: str = "shm",
    budget: Callable[[int, list[dict], list], None] | None = None,
) -> Case:
    """Run ``function`` on ``inputs``; check every rank's values, then ``budget`` (bytes, schedule)."""
    inputs = _seeded(inputs, seed)

    def check(outs: list) -> None:
        ref.check_values(function, world_size, inputs, outs, transport)
        if budget is not None:
            budget(world_size, inputs, outs)

    return Case(name, points, function, "run_cases", world_size, [function, inputs], check, transport)


#: the measured test of task 6 runs on these world sizes (a power of two and one that is not)
MEASURED_WORLD_SIZES = (4, 5)


def measured_tiers(p: int) -> Tiers:
    """Task 6's tiers on ``p`` ranks: the worst ratio over the sizes, lower is better."""
    return Tiers(
        quantity=f"allreduce time / the best textbook algorithm's, worst size, {p} ranks",
        unit="x",
        levels=((1.1, 1.0), (1.4, 0.5), (2.5, 0.25)),
        lower_is_better=True,
        baseline="the library's md.allreduce(algorithm='auto') reaches " + ("1.98x" if p == 4 else "1.59x"),
    )


def _measured(p: int, seed: int) -> Case:
    """fast_allreduce over ``timing.SIZES``: right values and real messages (as every value test),
    then the emulated time of the messages sent, against the best textbook allreduce at each size."""
    inputs = _seeded([{"shape": (size // 4,), "seed": 20 + i} for i, size in enumerate(timing.SIZES)], seed)

    def check(outs: list) -> float:
        replays = ref.check_values("fast_allreduce", p, inputs, outs)
        return max(
            timing.emulated_seconds(ranks) / timing.best_seconds(p, size)[1]
            for ranks, size in zip(replays, timing.SIZES, strict=True)
        )

    name = f"test_fast_allreduce_at_every_size[{p}]"
    return Case(
        name, 4, "fast_allreduce", "run_cases", p, ["fast_allreduce", inputs], check, "shm", measured_tiers(p)
    )


def _rejects(name: str, world_size: int, shape: tuple[int, ...]) -> Case:
    """ring_reduce_scatter must refuse a first dimension that ``world_size`` does not divide."""

    def check(outs: list) -> None:
        ref.check_rejects(world_size, shape, outs)

    return Case(name, 1, "ring_reduce_scatter", "reduce_scatter_rejects", world_size, [list(shape)], check)


def _transport_inputs(function: str) -> list[dict]:
    """The inputs of ``test_other_transports`` (p = 3)."""
    p = 3
    shapes = [(0,), (2 * p, 5), (p,)] if function == "ring_reduce_scatter" else [(0,), (2,), (7, 5)]
    inputs = [{"shape": shape, "seed": seed, "src": p - 1} for seed, shape in enumerate(shapes)]
    inputs.append({"shape": (2 * p, 3), "dtype": "float64", "layout": "transposed", "seed": 9, "src": 1})
    if function != "tree_broadcast":
        inputs = [{key: value for key, value in case.items() if key != "src"} for case in inputs]
    return inputs


def cases(seed: int) -> list[Case]:
    out: list[Case] = []
    add = out.append
    # task 1: tree_broadcast
    for p in ALL_WORLD_SIZES:
        add(
            _values(
                f"test_tree_broadcast[{p}]",
                1,
                "tree_broadcast",
                p,
                ref.value_cases("tree_broadcast", p),
                seed,
            )
        )
    for p in (5, 8):
        inputs, budget = ref.budget_cases("tree_broadcast", p), ref.check_tree_broadcast_budget
        name = f"test_tree_broadcast_sends_along_a_binomial_tree[{p}]"
        add(_values(name, 2, "tree_broadcast", p, inputs, seed, budget=budget))
    # task 2: ring_allgather
    for p in ALL_WORLD_SIZES:
        add(
            _values(
                f"test_ring_allgather[{p}]",
                1,
                "ring_allgather",
                p,
                ref.value_cases("ring_allgather", p),
                seed,
            )
        )
    for p in (3, 6):
        inputs, budget = ref.budget_cases("ring_allgather", p), ref.check_ring_allgather_budget
        add(_values(f"test_ring_allgather_budget[{p}]", 2, "ring_allgather", p, inputs, seed, budget=budget))
    add(
        _values("test_ring_allgather_large", 1, "ring_allgather", 4, [{"shape": (262_144,), "seed": 1}], seed)
    )
    # task 3: ring_reduce_scatter
    for p in ALL_WORLD_SIZES:
        inputs = ref.value_cases("ring_reduce_scatter", p)
        add(_values(f"test_ring_reduce_scatter[{p}]", 1, "ring_reduce_scatter", p, inputs, seed))
    for index, (p, shape) in enumerate([(3, (4, 2)), (4, (2,)), (4, (6, 0))]):
        add(
            _rejects(
                f"test_ring_reduce_scatter_rejects_indivisible_first_dimension[{p}-shape{index}]", p, shape
            )
        )
    for p in (3, 6):
        inputs, budget = ref.budget_cases("ring_reduce_scatter", p), ref.check_ring_reduce_scatter_budget
        name = f"test_ring_reduce_scatter_budget[{p}]"
        add(_values(name, 2, "ring_reduce_scatter", p, inputs, seed, budget=budget))
    inputs = [{"shape": (1_048_576,), "seed": 2}]
    add(_values("test_ring_reduce_scatter_large", 1, "ring_reduce_scatter", 4, inputs, seed))
    # tasks 4 and 5: allreduce
    for p in ALL_WORLD_SIZES:
        for function in ("ring_allreduce", "butterfly_allreduce"):
            add(
                _values(f"test_allreduce[{p}-{function}]", 1, function, p, ref.value_cases(function, p), seed)
            )
    for function, p in (("ring_allreduce", 4), ("butterfly_allreduce", 6)):
        inputs = [{"shape": (1_000_003,), "seed": 3}]
        add(_values(f"test_allreduce_large[{function}-{p}]", 2, function, p, inputs, seed))
    for p in (3, 4, 5, 8):
        inputs, budget = ref.budget_cases("ring_allreduce", p), ref.check_ring_allreduce_budget
        add(_values(f"test_ring_allreduce_budget[{p}]", 2, "ring_allreduce", p, inputs, seed, budget=budget))
    for p in (4, 6, 7, 8):
        inputs, budget = ref.budget_cases("butterfly_allreduce", p), ref.check_butterfly_allreduce_budget
        name = f"test_butterfly_allreduce_budget[{p}]"
        add(_values(name, 2, "butterfly_allreduce", p, inputs, seed, budget=budget))
    # task 6: fast_allreduce, correct on every input, then measured in tiers
    for p in (1, 3, 7):
        name = f"test_fast_allreduce[{p}]"
        add(_values(name, 1, "fast_allreduce", p, ref.value_cases("fast_allreduce", p), seed))
    for p in MEASURED_WORLD_SIZES:
        add(_measured(p, seed))
    # every function on the other transports
    for function in TASKS:
        if function == "fast_allreduce":  # its algorithms are tasks 4 and 5's, tested there
            continue
        for transport in ("pipe", "torch"):
            name = f"test_other_transports[{function}-{transport}]"
            add(_values(name, 1, function, 3, _transport_inputs(function), seed, transport))
    return out
