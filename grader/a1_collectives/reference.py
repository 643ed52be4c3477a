"""The trusted checks of assignment 1 (collectives). Instructors only: never copied to assignments/.

The hidden tests (``cases.py``) test what the public tests test, and more: 1 to 8 ranks, empty /
single-element / fewer-elements-than-ranks / not-divisible / large tensors, float64, int64 and
bfloat16, non-contiguous inputs, the "pipe" and "torch" transports, and the bytes and messages
of every rank, which must *equal* what the algorithm sends (within the rounding of the chunks):
a "ring" allreduce that gathers everything on rank 0 and broadcasts the sum is correct, and
fails the budget; so does one that moves fewer bytes than a ring (through shared memory).

The student's code gets a ``StudentComm`` (``grader/student_comm.py``: point-to-point only,
traffic counted per peer) in worker processes guarded by ``grader/guard.py`` (the library's and
torch's collectives refused, ``rules.py``). The budget tests cross-check the counters: what
rank i sent to j must be what j received from i, and what the transport underneath moved.

The folder holding the student's ``collectives.py`` must be on PYTHONPATH; it is imported
only in the worker processes (see ``workers.py``). References are computed here, in one
process, in float64 (or exactly, for integers); a float result may differ from it by the
rounding error of ``p`` additions:
``|got - exact| <= p * eps(dtype) * sum_r |x_r| + eps(dtype) * |exact|`` elementwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from . import transcript, workers

ALL_WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
TASKS = {
    "tree_broadcast": 1,
    "ring_allgather": 2,
    "ring_reduce_scatter": 3,
    "ring_allreduce": 4,
    "butterfly_allreduce": 5,
    "fast_allreduce": 6,
}


# --- checking what the ranks report ------------------------------------------------------------
def describe(case: dict) -> str:
    text = f"{case.get('dtype', 'float32')} input of shape {tuple(case['shape'])}"
    if case.get("layout", "contiguous") != "contiguous":
        text += f" ({case['layout']}, non-contiguous)"
    if "src" in case:
        text += f", src={case['src']}"
    return text


def check_close(where: str, got, expected: torch.Tensor, tolerance: torch.Tensor | None, dtype) -> None:
    """``got`` must have ``expected``'s shape and ``dtype``, and values within ``tolerance``."""
    if not isinstance(got, torch.Tensor):
        pytest.fail(
            f"{where}: got {type(got).__name__}, expected a tensor of shape {tuple(expected.shape)}",
            pytrace=False,
        )
    if got.shape != expected.shape or got.dtype != dtype:
        pytest.fail(
            f"{where}: got a {got.dtype} tensor of shape {tuple(got.shape)}, "
            f"expected {dtype} of shape {tuple(expected.shape)}",
            pytrace=False,
        )
    # with a tolerance, compare in float64; "not <=" also counts NaN as wrong
    wrong = got != expected if tolerance is None else ~((got.double() - expected).abs() <= tolerance)
    if wrong.any():
        positions = wrong.nonzero()
        index = tuple(positions[0].tolist())
        pytest.fail(
            f"{where}: element {index} is {got[index].item()}, expected {expected[index].item()} "
            f"({len(positions)} of {expected.numel()} elements are wrong)",
            pytrace=False,
        )


def inputs_of(case: dict, world_size: int) -> list[torch.Tensor]:
    return [workers.make_input(case, rank).contiguous() for rank in range(world_size)]


def exact_sum(inputs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The exact sum (float64 for floats) and the tolerance a float result may deviate by."""
    if not inputs[0].dtype.is_floating_point:
        return torch.stack(inputs).sum(0), None
    stacked = torch.stack([x.double() for x in inputs])
    exact = stacked.sum(0)
    eps = torch.finfo(inputs[0].dtype).eps
    tolerance = len(inputs) * eps * stacked.abs().sum(0) + eps * exact.abs()
    return exact, tolerance


def expected_of(function: str, case: dict, inputs: list[torch.Tensor], rank: int):
    """(expected value, tolerance or None) for ``rank``'s result of ``case``."""
    if function == "tree_broadcast":
        return inputs[case["src"]], None
    if function == "ring_allgather":
        return torch.stack(inputs), None
    exact, tolerance = exact_sum(inputs)
    if function == "ring_reduce_scatter":
        block = inputs[0].shape[0] // len(inputs)
        rows = slice(rank * block, (rank + 1) * block)
        return exact[rows], None if tolerance is None else tolerance[rows]
    return exact, tolerance


def check_values(
    function: str, world_size: int, cases: list[dict], outs: list, transport: str = "shm"
) -> list:
    """Every rank's result of every case against a single-process reference; inputs must stay untouched.

    ``outs[rank][case index]`` is what ``workers.run_cases`` reported. The grader calls this
    too, in its own (trusted) process, on reports read back from the sandbox. Returns, per case,
    every rank's messages as ``transcript.replay`` read them (what ``timing`` times).
    """
    if not isinstance(outs, list) or len(outs) != world_size:
        pytest.fail(f"{function}: expected reports from {world_size} ranks", pytrace=False)
    for rank_reports in outs:
        if not isinstance(rank_reports, list) or len(rank_reports) != len(cases):
            pytest.fail(f"{function}: expected {len(cases)} reports per rank", pytrace=False)
        if not all(isinstance(report, dict) and "result" in report for report in rank_reports):
            pytest.fail(f"{function}: a report without a result", pytrace=False)
    replays = []
    for index, case in enumerate(cases):
        inputs = inputs_of(case, world_size)
        dtype = workers.DTYPES[case.get("dtype", "float32")]
        for rank, reports in enumerate(outs):
            report = reports[index]
            where = f"{function} on {world_size} ranks ({transport}), {describe(case)}: rank {rank}"
            expected, tolerance = expected_of(function, case, inputs, rank)
            check_close(where, report["result"], expected, tolerance, dtype)
            if "input_after" in report and not _same(report["input_after"], inputs[rank]):
                pytest.fail(f"{where}: the input was modified; {function} must leave it alone", pytrace=False)
        replays.append(replay(function, world_size, case, index, outs, inputs, transport))
    return replays


def replay(function: str, p: int, case: dict, index: int, outs: list, inputs: list, transport: str = "shm"):
    """The messages of every rank for ``case`` (``outs[rank][index]``), replayed by ``transcript``:
    each carries real data its sender had, and each rank received what its result depends on."""
    where = f"{function} on {p} ranks ({transport}), {describe(case)}"
    transcripts = [reports[index].get("transcript") for reports in outs]
    return transcript.replay(function, p, where, transcripts, inputs, case.get("src"))


def _same(got, expected: torch.Tensor) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and got.shape == expected.shape
        and got.dtype == expected.dtype
        and torch.equal(got, expected)
    )


# --- the inputs ----------------------------------------------------------------------------
def shapes_for(function: str, p: int) -> list[tuple[int, ...]]:
    if function == "ring_reduce_scatter":  # dim 0 must be a multiple of p
        return [(0,), (p,), (2 * p, 3), (p, 0), (3 * p,)]
    # empty, one element, fewer elements than ranks, not divisible by p, a 0-dim tensor, 2-D, 3-D
    return [(0,), (1,), (max(p - 1, 1),), (p + 1,), (), (7, 13), (2, 3, 4), (100,)]


def special_cases(function: str, p: int) -> list[dict]:
    """Other dtypes and non-contiguous layouts."""
    rows = 2 * p if function == "ring_reduce_scatter" else 6
    return [
        {"shape": (rows, 5), "dtype": "float64"},
        {"shape": (rows, 7), "dtype": "int64"},
        {"shape": (rows, 9), "dtype": "bfloat16"},
        {"shape": (rows, 3), "layout": "transposed"},
        {"shape": (rows, 4), "layout": "strided"},
        {"shape": (rows,), "layout": "strided", "dtype": "int64"},
    ]


def value_cases(function: str, p: int) -> list[dict]:
    cases = [{"shape": shape} for shape in shapes_for(function, p)] + special_cases(function, p)
    if function == "tree_broadcast":
        sources = sorted({0, p // 2, p - 1})
        cases = [{**case, "src": sources[i % len(sources)]} for i, case in enumerate(cases)]
        cases += [{"shape": (5,), "src": src} for src in range(p)]
    return [{**case, "seed": seed} for seed, case in enumerate(cases)]


def budget_cases(function: str, p: int) -> list[dict]:
    rows = 1000 * p if function == "ring_reduce_scatter" else 1000  # reduce-scatter: dim 0 divisible by p
    shapes = [(rows,), (p, 3, 11), (10_001 if function != "ring_reduce_scatter" else p, 7)]
    cases = [{"shape": shape, "seed": seed} for seed, shape in enumerate(shapes)]
    cases.append({"shape": shapes[0], "dtype": "float64", "seed": len(cases)})
    if function == "tree_broadcast":
        cases = [{**case, "src": (seed + 1) % p} for seed, case in enumerate(cases)]
    return cases


def nbytes_of(case: dict) -> tuple[int, int]:
    """(number of elements, bytes) of one rank's input."""
    numel = math.prod(case["shape"])
    return numel, numel * torch.empty(0, dtype=workers.DTYPES[case.get("dtype", "float32")]).element_size()


TRAFFIC_KEYS = ("sent_bytes", "sent_messages", "received_bytes", "received_messages")


def traffic_of(function: str, p: int, report: dict) -> dict:
    """A rank's per-peer traffic from its report, checked for shape (it comes from the sandbox)."""
    traffic = report.get("traffic") if isinstance(report, dict) else None
    if not isinstance(traffic, dict) or not all(
        isinstance(traffic.get(key), list)
        and len(traffic[key]) == p
        and all(isinstance(v, int) and v >= 0 for v in traffic[key])
        for key in TRAFFIC_KEYS
    ):
        pytest.fail(f"{function}: a report without per-peer traffic counts", pytrace=False)
    return traffic


def totals(traffic: dict) -> dict:
    """``bytes_sent``, ``messages_sent``, ``bytes_received``, ``messages_received`` of one rank."""
    return {
        "bytes_sent": sum(traffic["sent_bytes"]),
        "messages_sent": sum(traffic["sent_messages"]),
        "bytes_received": sum(traffic["received_bytes"]),
        "messages_received": sum(traffic["received_messages"]),
    }


def check_pairs(function: str, p: int, case: dict, traffics: list[dict]) -> None:
    """What rank i sent to rank j must be what j received from i; the library must agree.

    Each rank counts its own traffic, so one rank's counters alone prove nothing; the
    counters of two ranks that disagree mean the counting was tampered with. The library's
    own byte counters under the wrapper must match too (bytes sent around the wrapper).
    """
    for i in range(p):
        for j in range(p):
            for unit in ("messages", "bytes"):
                sent, received = traffics[i][f"sent_{unit}"][j], traffics[j][f"received_{unit}"][i]
                if sent != received:
                    pytest.fail(
                        f"{function} on {p} ranks, {describe(case)}: rank {i} counted {sent} {unit} sent to "
                        f"rank {j}, which counted {received} {unit} received from rank {i}: the traffic "
                        "counters were changed by the submission",
                        pytrace=False,
                    )
    for rank, traffic in enumerate(traffics):
        library, counted = (
            traffic.get("library_bytes"),
            [
                sum(traffic["sent_bytes"]),
                sum(traffic["received_bytes"]),
            ],
        )
        if library != counted:
            pytest.fail(
                f"{function} on {p} ranks, {describe(case)}: rank {rank}: the transport moved {library} "
                f"bytes "
                f"(sent, received), the communicator your code was given counted {counted}: "
                "messages went around it",
                pytrace=False,
            )


def check_exact(function: str, p: int, case: dict, rank: int, stats: dict, expected: dict, why: str) -> None:
    """Every ``stats[key]`` must equal ``expected[key]``: an int, or an inclusive (low, high) range."""
    for key, want in expected.items():
        low, high = want if isinstance(want, tuple) else (want, want)
        got = stats[key]
        if low <= got <= high:
            continue
        numel, nbytes = nbytes_of(case)
        budget = f"{low}" if low == high else f"{low} to {high}"
        where = "over the budget of" if got > high else "under the exact count of"
        more = "" if got > high else " (data that did not go through comm.send/isend?)"
        pytest.fail(
            f"{function} on {p} ranks, {describe(case)} ({numel} elements, {nbytes} bytes): rank {rank}: "
            f"{key.replace('_', ' ')} = {got}, {where} {budget}{more}. {why}",
            pytrace=False,
        )


def check_budgets(function: str, p: int, cases: list[dict], outs: list, expected_of, why: str) -> None:
    """For each case: the pair cross-check, then each rank's totals against ``expected_of(case, rank)``.

    ``expected_of`` may also return ``"total_bytes"``: the sum of ``bytes_sent`` over all ranks.
    """
    for index, case in enumerate(cases):
        traffics = [traffic_of(function, p, reports[index]) for reports in outs]
        check_pairs(function, p, case, traffics)
        total = sum(totals(t)["bytes_sent"] for t in traffics)
        for rank, traffic in enumerate(traffics):
            expected = dict(expected_of(case, rank))
            expected_total = expected.pop("total_bytes", None)
            check_exact(function, p, case, rank, totals(traffic), expected, why)
            if expected_total is not None and total != expected_total:
                pytest.fail(
                    f"{function} on {p} ranks, {describe(case)}: {total} bytes sent by all ranks together, "
                    f"exactly {expected_total} expected. {why}",
                    pytrace=False,
                )


def check_ring_neighbours(function: str, p: int, cases: list[dict], outs: list) -> None:
    """In a ring every rank sends only to its right neighbour and receives only from its left one."""
    for index, case in enumerate(cases):
        for rank, reports in enumerate(outs):
            traffic = traffic_of(function, p, reports[index])
            right, left = (rank + 1) % p, (rank - 1) % p
            strays = [j for j in range(p) if j != right and traffic["sent_messages"][j]]
            strays += [j for j in range(p) if j != left and traffic["received_messages"][j]]
            if strays:
                pytest.fail(
                    f"{function} on {p} ranks, {describe(case)}: rank {rank} exchanged messages with rank "
                    f"{strays[0]}; in a ring rank {rank} sends only to {right} and receives only from {left}",
                    pytrace=False,
                )


def chunk_range(numel: int, parts: int, chunks: int, itemsize: int) -> tuple[int, int]:
    """Bytes of ``chunks`` chunks of a ``numel``-element tensor cut into ``parts`` near-equal chunks."""
    return chunks * (numel // parts) * itemsize, chunks * math.ceil(numel / parts) * itemsize


def check_schedule(function: str, p: int, cases: list[dict], outs: list, expected_sends, why: str) -> None:
    """Each rank's messages, in order, against the algorithm's schedule: the peer of each send
    and the ranks whose data it carries (found by replaying the transcripts, ``transcript.py``).

    ``expected_sends(case, rank, sends)`` returns, per send, ``(peer, ranks)``: ``ranks`` is the
    set of ranks whose data the message must carry (a sum over them, or in an allgather the one
    input it must be), or None where only the peer is fixed.
    """
    for index, case in enumerate(cases):
        ranks = replay(function, p, case, index, outs, inputs_of(case, p))
        for rank, messages in enumerate(ranks):
            sends = [m for m in messages if m.op == "send"]
            expected = expected_sends(case, rank, sends)
            where = f"{function} on {p} ranks, {describe(case)}: rank {rank}"
            if len(sends) != len(expected):
                pytest.fail(
                    f"{where} sent {len(sends)} messages, the schedule {len(expected)}. {why}", pytrace=False
                )
            for step, (message, (peer, carried)) in enumerate(zip(sends, expected)):
                if message.peer != peer:
                    pytest.fail(
                        f"{where}: its {transcript.ordinal(step + 1)} message went to rank {message.peer}, "
                        f"the schedule sends it to rank {peer}. {why}",
                        pytrace=False,
                    )
                if carried is None or message.numel == 0:
                    continue
                if message.segments is not None:
                    found = [set(message.segments)]
                else:
                    found = [set(transcript.ranks_of(mask)) for mask, _, _ in message.match]
                if set(carried) not in found:
                    pytest.fail(
                        f"{where}: its {transcript.ordinal(step + 1)} message carries the data of ranks "
                        f"{sorted(found[0])}; at that step the schedule sends the data of ranks "
                        f"{sorted(carried)}. {why}",
                        pytrace=False,
                    )


def ring_sends(function: str, p: int):
    """The ring's schedule (``check_schedule``), in whichever direction the rank sends: at step
    k the partial sum over the k + 1 ranks behind it (reduce-scatter), then complete sums
    (allgather phase of the allreduce); in an allgather, the input of the rank k behind it."""

    def expected(case: dict, rank: int, sends: list) -> list:
        step = 1 if not sends or sends[0].peer == (rank + 1) % p else -1
        peer = (rank + step) % p
        behind = [[(rank - i * step) % p for i in range(k + 1)] for k in range(p)]
        if function == "ring_allgather":
            return [(peer, [(rank - k * step) % p]) for k in range(p - 1)]
        schedule = [(peer, behind[k]) for k in range(p - 1)]
        if function == "ring_allreduce":
            schedule += [(peer, list(range(p)))] * (p - 1)
        return schedule

    return expected


def binomial_tree_sends(p: int, vrank: int) -> int:
    """Messages rank ``vrank`` (numbered from the source) sends in the doubling binomial tree."""
    sends, distance = 0, 1
    while distance < p:
        if vrank < distance and vrank + distance < p:
            sends += 1
        distance *= 2
    return sends


# --- task 1: tree_broadcast ------------------------------------------------------------------
def check_tree_broadcast_budget(world_size: int, cases: list[dict], outs: list) -> None:
    p = world_size
    rounds = math.ceil(math.log2(p))
    why = (
        f"The binomial tree of the docstring takes ceil(log2 p) = {rounds} rounds; in round k the ranks "
        "with vrank < 2**k send to vrank + 2**k: the source sends one message per round, every other rank "
        "receives exactly one, and p - 1 messages travel in all."
    )

    def expected(case: dict, rank: int) -> dict:
        nbytes = nbytes_of(case)[1]
        sends = binomial_tree_sends(p, (rank - case["src"]) % p)
        received = 0 if rank == case["src"] else 1
        return {
            "bytes_sent": sends * nbytes,
            "bytes_received": received * nbytes,
            "messages_sent": sends,
            "messages_received": received,
            "total_bytes": (p - 1) * nbytes,
        }

    check_budgets("tree_broadcast", p, cases, outs, expected, why)

    def schedule(case: dict, rank: int, sends: list) -> list:
        src, vrank, distance, order = case["src"], (rank - case["src"]) % p, 1, []
        while distance < p:
            if vrank < distance and vrank + distance < p:
                order.append(((vrank + distance + src) % p, [src]))
            distance *= 2
        return order

    check_schedule("tree_broadcast", p, cases, outs, schedule, why)


# --- task 2: ring_allgather ------------------------------------------------------------------


def check_ring_allgather_budget(world_size: int, cases: list[dict], outs: list) -> None:
    p = world_size
    why = "In a ring allgather every rank sends (p - 1) tensors of n bytes to its right neighbour."

    def expected(case: dict, rank: int) -> dict:
        nbytes = nbytes_of(case)[1]
        each = {"bytes_sent": (p - 1) * nbytes, "messages_sent": p - 1}
        each.update(bytes_received=(p - 1) * nbytes, messages_received=p - 1)
        return each

    check_budgets("ring_allgather", p, cases, outs, expected, why)
    check_ring_neighbours("ring_allgather", p, cases, outs)
    check_schedule("ring_allgather", p, cases, outs, ring_sends("ring_allgather", p), why)


# --- task 3: ring_reduce_scatter -------------------------------------------------------------


def check_rejects(world_size: int, shape: tuple[int, ...], outs: list) -> None:
    if not isinstance(outs, list) or len(outs) != world_size:
        pytest.fail(f"ring_reduce_scatter: expected reports from {world_size} ranks", pytrace=False)
    for rank, out in enumerate(outs):
        where = f"ring_reduce_scatter on {world_size} ranks, input shape {shape}: rank {rank}"
        if out["error"] is None:
            pytest.fail(
                f"{where}: expected a ValueError (dim 0 is not a multiple of {world_size})", pytrace=False
            )
        stats = totals(traffic_of("ring_reduce_scatter", world_size, out))
        if stats["messages_sent"] or stats["messages_received"]:
            pytest.fail(
                f"{where}: raised ValueError only after communicating; check the shape first", pytrace=False
            )


def check_ring_reduce_scatter_budget(world_size: int, cases: list[dict], outs: list) -> None:
    p = world_size
    why = "In a ring reduce-scatter every rank sends p - 1 partial sums of one block (n / p bytes)."

    def expected(case: dict, rank: int) -> dict:
        block = nbytes_of(case)[1] // p
        each = {"bytes_sent": (p - 1) * block, "messages_sent": p - 1}
        each.update(bytes_received=(p - 1) * block, messages_received=p - 1)
        return each

    check_budgets("ring_reduce_scatter", p, cases, outs, expected, why)
    check_ring_neighbours("ring_reduce_scatter", p, cases, outs)
    check_schedule("ring_reduce_scatter", p, cases, outs, ring_sends("ring_reduce_scatter", p), why)


# --- tasks 4 and 5: allreduce ----------------------------------------------------------------


def check_ring_allreduce_budget(world_size: int, cases: list[dict], outs: list) -> None:
    p = world_size
    why = (
        "A ring allreduce sends 2 (p - 1) chunks of about n / p bytes per rank to its right neighbour "
        "(reduce-scatter, then allgather): 2 (p - 1) / p * n in all, up to the rounding of the chunks. "
        "Gathering everything on one rank and broadcasting the sum gives the right answer, but it is "
        "not a ring: that rank sends far more."
    )

    def expected(case: dict, rank: int) -> dict:
        numel, nbytes = nbytes_of(case)
        chunks = chunk_range(numel, p, 2 * (p - 1), nbytes // max(numel, 1))
        each = {"bytes_sent": chunks, "bytes_received": chunks}
        each.update(messages_sent=2 * (p - 1), messages_received=2 * (p - 1))
        return {**each, "total_bytes": 2 * (p - 1) * nbytes}

    check_budgets("ring_allreduce", p, cases, outs, expected, why)
    check_ring_neighbours("ring_allreduce", p, cases, outs)
    check_schedule("ring_allreduce", p, cases, outs, ring_sends("ring_allreduce", p), why)


def check_butterfly_allreduce_budget(world_size: int, cases: list[dict], outs: list) -> None:
    p = world_size
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
    steps = 2 * int(math.log2(p2))
    why = (
        f"Recursive halving and doubling over p2 = {p2} ranks take 2 log2 p2 = {steps} messages and "
        "2 (p2 - 1) / p2 * n bytes per rank (up to the rounding of the chunks); of the first "
        f"2 * (p - p2) = {2 * rem} ranks, the even ones send their n bytes to the next rank and get the "
        "result back (one message each way), the odd ones take part in the butterfly and have these "
        "two n-byte messages on top. A ring needs 2 (p - 1) messages."
    )

    def expected(case: dict, rank: int) -> dict:
        numel, nbytes = nbytes_of(case)
        itemsize = nbytes // max(numel, 1)
        total = 2 * (p2 - 1) * nbytes + 2 * rem * nbytes
        if rank < 2 * rem and rank % 2 == 0:  # sits out the butterfly
            each = {
                "bytes_sent": nbytes,
                "bytes_received": nbytes,
                "messages_sent": 1,
                "messages_received": 1,
            }
            return {**each, "total_bytes": total}
        fold = nbytes if rank < 2 * rem else 0
        low, high = chunk_range(numel, p2, 2 * (p2 - 1), itemsize)
        slack = steps * itemsize  # halves that round differently from chunk_offsets
        bytes_range = (low - slack + fold, high + slack + fold)
        messages = steps + (1 if fold else 0)
        each = {"bytes_sent": bytes_range, "bytes_received": bytes_range}
        each.update(messages_sent=messages, messages_received=messages)
        return {**each, "total_bytes": total}

    check_budgets("butterfly_allreduce", p, cases, outs, expected, why)

    def real_rank(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    def schedule(case: dict, rank: int, sends: list) -> list:
        """Partners only: fold in, halving (d = p2/2 .. 1), doubling (d = 1 .. p2/2), fold out."""
        if rank < 2 * rem and rank % 2 == 0:
            return [(rank + 1, [rank])]
        vrank = rank // 2 if rank < 2 * rem else rank - rem
        distances = [p2 >> i for i in range(1, steps // 2 + 1)]
        order = [(real_rank(vrank ^ d), None) for d in distances + distances[::-1]]
        return order + ([(rank - 1, list(range(p)))] if rank < 2 * rem else [])

    check_schedule("butterfly_allreduce", p, cases, outs, schedule, why)
