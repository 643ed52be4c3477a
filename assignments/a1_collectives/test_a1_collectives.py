"""Public tests of assignment 1. Run them from this folder with

    python -m pytest -q test_a1_collectives.py

Each test runs one of your functions on 2, 3 and 4 ranks (transport "shm") with fixed
inputs, and compares what every rank ends up with against a reference computed here, in a
single process, with plain torch. The inputs are whole numbers stored as float32, so every
correct summation order gives exactly the same result and any difference is a bug. A failure
names the function, the number of ranks, the rank, the input shape and the first element
that differs.

Your module is imported inside the worker processes, afresh at every launch, so an error
in it is reported as a test failure, and your latest edits are always what runs.

Two kinds of tests check more than the values, because the grader does too:

* **the budget**: each rank's bytes and messages, read from ``comm.stats`` around the call,
  must *equal* what the algorithm of the docstring sends (a ring allreduce: exactly 2 (p - 1)
  messages of n / p bytes). An algorithm that gets the right values with other traffic (all
  to rank 0, say) fails them.
* **a non-contiguous input** (a transposed matrix): ``send``/``recv`` work on whole tensors,
  so a view that is not one block of memory needs care.

Task 6 (``fast_allreduce``) is checked here for its values only: its bytes and messages are
yours to choose, and the grader times them (the notebook's section 7 shows how).

The grader runs more of both, and more ranks, other dtypes, the other transports and large
tensors. It also refuses code that calls the library's collectives (``md.allreduce`` and
friends, ``minidist.collectives``) or ``torch.distributed``'s: write them with ``comm.send``,
``comm.recv``, ``comm.isend``, ``comm.irecv`` and the helpers in ``collectives.py``.
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
    "fast_allreduce": 6,
}
#: the functions whose bytes and messages are prescribed (task 6's are measured, not prescribed)
BUDGETED = [function for function in TASKS if function != "fast_allreduce"]


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


def traffic_of_one_call(comm, function: str, shape: tuple[int, ...], transposed: bool) -> dict:
    """Call ``function`` once; return what this rank holds after it and what it sent and received."""
    import collectives

    x = rank_input(shape[::-1] if transposed else shape, comm.rank, seed=7)
    x = x.t() if transposed else x  # a transposed matrix: not one contiguous block of memory
    fn = getattr(collectives, function)
    before = comm.stats
    returned = fn(comm, x, 0) if function == "tree_broadcast" else fn(comm, x)
    delta = comm.stats - before
    in_place = function == "tree_broadcast" or function.endswith("allreduce")
    return {"result": x if in_place else returned, "stats": vars(delta)}


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


@pytest.mark.parametrize("function", ["ring_allreduce", "butterfly_allreduce", "fast_allreduce"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_allreduce(function, world_size):
    cases = [(shape, seed, None) for seed, shape in enumerate(shapes_for(world_size))]
    run_and_compare(function, world_size, cases, lambda inputs, rank, src: sum(inputs))


# --- the budget and a non-contiguous input ---------------------------------------------------
BUDGET_SHAPE = (12, 5)  # 60 float32 elements, 240 bytes: a multiple of 3 and 4, so chunks are equal


def expected_traffic(function: str, p: int, rank: int, nbytes: int) -> dict:
    """What ``rank`` sends and receives in the algorithm of the docstring (src = 0 for the tree)."""
    if function == "tree_broadcast":  # round k: ranks below 2**k send to rank + 2**k
        sends = sum(1 for k in range(p.bit_length()) if rank < 2**k and rank + 2**k < p)
        received = 0 if rank == 0 else 1
        return {"messages_sent": sends, "bytes_sent": sends * nbytes, "bytes_received": received * nbytes}
    if function == "ring_allgather":
        return {"messages_sent": p - 1, "bytes_sent": (p - 1) * nbytes, "bytes_received": (p - 1) * nbytes}
    if function == "ring_reduce_scatter":
        block = nbytes // p
        return {"messages_sent": p - 1, "bytes_sent": (p - 1) * block, "bytes_received": (p - 1) * block}
    if function == "ring_allreduce":
        chunks = 2 * (p - 1) * (nbytes // p)
        return {"messages_sent": 2 * (p - 1), "bytes_sent": chunks, "bytes_received": chunks}
    p2 = 1 << (p.bit_length() - 1)  # butterfly: the first 2 (p - p2) ranks fold in and out
    rem, steps = p - p2, 2 * (p2.bit_length() - 1)
    if rank < 2 * rem and rank % 2 == 0:
        return {"messages_sent": 1, "bytes_sent": nbytes, "bytes_received": nbytes}
    fold = nbytes if rank < 2 * rem else 0
    butterfly = 2 * (p2 - 1) * (nbytes // p2) + fold
    return {"messages_sent": steps + (1 if fold else 0), "bytes_sent": butterfly, "bytes_received": butterfly}


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("function", BUDGETED)
def test_every_rank_sends_exactly_what_the_algorithm_sends(function, world_size):
    outs = launch(traffic_of_one_call, function, world_size, (function, BUDGET_SHAPE, False))
    nbytes = 12 * 5 * 4
    for rank, out in enumerate(outs):
        expected = expected_traffic(function, world_size, rank, nbytes)
        got = {key: out["stats"][key] for key in expected}
        assert got == expected, (
            f"{function} on {world_size} ranks, input shape {BUDGET_SHAPE} ({nbytes} bytes), rank {rank}: "
            f"sent and received {got}, but the algorithm of the docstring sends exactly {expected}"
        )


@pytest.mark.parametrize("function", list(TASKS))
def test_a_non_contiguous_input(function):
    world_size = 3
    shape = (6, 4)  # dim 0 a multiple of 3 for reduce-scatter
    outs = launch(traffic_of_one_call, function, world_size, (function, shape, True))
    inputs = [rank_input(shape[::-1], r, seed=7).t() for r in range(world_size)]
    for rank, out in enumerate(outs):
        where = f"{function} on {world_size} ranks, a transposed (non-contiguous) input {shape}, rank {rank}"
        if function == "tree_broadcast":
            expected = inputs[0]
        elif function == "ring_allgather":
            expected = torch.stack(inputs)
        elif function == "ring_reduce_scatter":
            expected = sum(inputs)[rank * 2 : (rank + 1) * 2]
        else:
            expected = sum(inputs)
        check_result(where, out["result"], expected.contiguous())
