"""Public tests of assignment 1. Run them from this folder with

    python -m pytest -q test_a1_collectives.py

Each test runs one of your functions on 2, 3 and 4 ranks (transport "shm") with fixed
inputs, and compares what every rank ends up with against a reference computed here, in a
single process, with plain torch. The inputs are whole numbers stored as float32, so every
correct summation order gives exactly the same result and any difference is a bug. A failure
names the function, the number of ranks, the rank, the input shape and the first element
that differs.

Your module is imported inside the worker processes, afresh at every launch, so an error
in it is reported as a test failure, and your latest edits are always what runs. The
grader runs more tests than these: more ranks, other dtypes, non-contiguous tensors, the
other transports, large tensors, and a budget of bytes and messages per rank.
"""

from __future__ import annotations

import pytest
import torch

import minidist as md

WORLD_SIZES = [2, 3, 4]
TIMEOUT = 30  # seconds: a deadlock fails the test instead of hanging it
TASKS = {
    "tree_broadcast": 1,
    "ring_allgather": 2,
    "ring_reduce_scatter": 3,
    "ring_allreduce": 4,
    "butterfly_allreduce": 5,
}


def rank_input(shape: tuple[int, ...], rank: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input: whole numbers in [-9, 9] as float32 (sums of them are exact)."""
    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randint(-9, 10, shape, generator=generator).to(torch.float32)


# --- what runs in the worker processes ----------------------------------------------------
def run_cases(comm, function: str, cases: list[tuple]) -> list:
    """Call ``collectives.<function>`` once per case; return what this rank holds after each."""
    import collectives  # imported here, in the worker: see the module docstring

    fn = getattr(collectives, function)
    results = []
    for shape, seed, src in cases:
        x = rank_input(shape, comm.rank, seed)
        if function == "tree_broadcast":
            fn(comm, x, src)
            results.append(x)
        elif function.endswith("allreduce"):
            fn(comm, x)
            results.append(x)
        else:
            results.append(fn(comm, x))
    return results


def reduce_scatter_errors(comm, shape: tuple[int, ...]) -> str:
    """Call ring_reduce_scatter on a bad shape; return the error it raised (or "none")."""
    import collectives

    try:
        collectives.ring_reduce_scatter(comm, torch.zeros(shape))
    except ValueError as error:
        return f"ValueError: {error}"
    return "none"


# --- what runs here ------------------------------------------------------------------------
def launch(worker, function: str, world_size: int, args: tuple) -> list:
    """md.launch, with failures turned into messages that say what to do."""
    try:
        return md.launch(worker, world_size, args=args, transport="shm", timeout=TIMEOUT)
    except md.WorkerError as error:
        if error.exc_type == "NotImplementedError":
            failure = (
                f"{function} is not implemented yet: rank {error.rank} raised {error.summary}\n"
                f"-> fill in TODO(task {TASKS[function]}) in collectives.py"
            )
        else:
            failure = f"{function} failed on {world_size} ranks: {error}"
    except md.LaunchTimeout as error:
        failure = f"{function} did not finish within {TIMEOUT} s on {world_size} ranks (a deadlock?): {error}"
    pytest.fail(failure, pytrace=False)  # outside the except: no chained traceback to wade through


def check_result(where: str, got, expected: torch.Tensor) -> None:
    """Fail with a readable message unless ``got`` equals ``expected`` exactly."""
    if not isinstance(got, torch.Tensor):
        pytest.fail(
            f"{where}: returned {type(got).__name__}, expected a tensor of shape {tuple(expected.shape)}",
            pytrace=False,
        )
    if got.shape != expected.shape or got.dtype != expected.dtype:
        pytest.fail(
            f"{where}: got a {got.dtype} tensor of shape {tuple(got.shape)}, "
            f"expected {expected.dtype} of shape {tuple(expected.shape)}",
            pytrace=False,
        )
    if not torch.equal(got, expected):
        wrong = (got != expected).nonzero()
        index = tuple(wrong[0].tolist())
        pytest.fail(
            f"{where}: element {index} is {got[index].item()}, expected {expected[index].item()} "
            f"({len(wrong)} of {expected.numel()} elements are wrong)",
            pytrace=False,
        )


def shapes_for(world_size: int) -> list[tuple[int, ...]]:
    """Empty, a single element, fewer elements than ranks, a vector, a matrix."""
    return [(0,), (1,), (world_size - 1,), (10,), (3, 5)]


def run_and_compare(function: str, world_size: int, cases: list[tuple], expected_of) -> None:
    outs = launch(run_cases, function, world_size, (function, cases))
    for rank, results in enumerate(outs):
        for (shape, seed, src), got in zip(cases, results):
            source = f", src={src}" if function == "tree_broadcast" else ""
            where = f"{function} on {world_size} ranks, input shape {shape}{source}, rank {rank}"
            inputs = [rank_input(shape, r, seed) for r in range(world_size)]
            check_result(where, got, expected_of(inputs, rank, src))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_tree_broadcast(world_size):
    cases = [
        (shape, seed, src) for seed, shape in enumerate(shapes_for(world_size)) for src in (0, world_size - 1)
    ]
    run_and_compare("tree_broadcast", world_size, cases, lambda inputs, rank, src: inputs[src])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_allgather(world_size):
    cases = [(shape, seed, None) for seed, shape in enumerate(shapes_for(world_size))]
    run_and_compare("ring_allgather", world_size, cases, lambda inputs, rank, src: torch.stack(inputs))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ring_reduce_scatter(world_size):
    shapes = [(0,), (world_size,), (2 * world_size, 3)]  # dim 0 must be a multiple of world_size
    cases = [(shape, seed, None) for seed, shape in enumerate(shapes)]

    def expected(inputs, rank, src):
        block = inputs[0].shape[0] // world_size
        return sum(inputs)[rank * block : (rank + 1) * block]

    run_and_compare("ring_reduce_scatter", world_size, cases, expected)


def test_ring_reduce_scatter_rejects_a_first_dimension_not_divisible_by_world_size():
    outs = launch(reduce_scatter_errors, "ring_reduce_scatter", 3, ((4, 2),))
    for rank, error in enumerate(outs):
        assert error.startswith("ValueError"), (
            f"ring_reduce_scatter on 3 ranks with input shape (4, 2), rank {rank}: "
            "expected a ValueError (4 rows cannot be split into 3 equal blocks), but nothing was raised"
        )


@pytest.mark.parametrize("function", ["ring_allreduce", "butterfly_allreduce"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allreduce(function, world_size):
    cases = [(shape, seed, None) for seed, shape in enumerate(shapes_for(world_size))]
    run_and_compare(function, world_size, cases, lambda inputs, rank, src: sum(inputs))
