"""all_to_all against a reference built in the test process, and its bytes against the formula.

Each launch runs every case (equal and variable split, zero-size pieces, non-contiguous
input, several dtypes, async, an emulated link); the tests read the module fixture's
results. The reference: rank r's output row/entry i is rank i's piece r, from the seeded
inputs of every rank (``all_to_all_workers``), so it shares no code with the collective.
"""

from __future__ import annotations

import math

import pytest
import torch

import all_to_all_workers as workers
import minidist as md
from minidist.collectives import cost_model

# (transport, world size): every p in 1..4 and every transport once, in five launches
WORLDS = [("shm", 1), ("pipe", 2), ("shm", 3), ("pipe", 4), ("torch", 3)]


def cases() -> list[dict]:
    out = []
    chunks = [
        ((), "float32", False),
        ((3,), "int64", False),
        ((0,), "float32", False),
        ((2, 5), "bfloat16", True),
    ]
    for seed, (chunk, dtype, noncontig) in enumerate(chunks):
        out.append({"kind": "equal", "chunk": chunk, "dtype": dtype, "noncontig": noncontig, "seed": seed})
    for seed, (trailing, dtype) in enumerate(
        [((4,), "float32"), ((), "int64"), ((2, 0), "float64")], start=10
    ):
        for given in (False, True):
            out.append(
                {"kind": "split", "trailing": trailing, "dtype": dtype, "given": given, "seed": seed + given}
            )
    both = {"chunk": (3,), "trailing": (2,), "dtype": "float64", "seed": 20}
    out.append({"kind": "async", **both})
    out.append({"kind": "emulated", "chunk": (4,), "dtype": "float32", "seed": 21})
    return out


CASES = cases()


@pytest.fixture(scope="module")
def runs():
    """{(transport, p): per-rank [(result, stats delta)]}: one launch per world."""
    return {
        (transport, p): md.launch(workers.run_cases, p, args=(CASES,), transport=transport, timeout=120)
        for transport, p in WORLDS
    }


def expected_equal(case: dict, rank: int, p: int) -> torch.Tensor:
    return torch.stack([workers.equal_input(case, i, p)[rank] for i in range(p)])


def expected_split(case: dict, rank: int, p: int) -> list[torch.Tensor]:
    return [workers.split_input(case, i, p)[rank] for i in range(p)]


def assert_same_list(got: list[torch.Tensor], want: list[torch.Tensor], what) -> None:
    assert isinstance(got, list) and len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w), what


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0]}-p{w[1]}")
def test_results_equal_the_reference(runs, world):
    transport, p = world
    for i, case in enumerate(CASES):
        for rank in range(p):
            got, _ = runs[world][rank][i]
            what = (case, rank, transport)
            if case["kind"] in ("equal", "emulated"):
                want = expected_equal(case, rank, p)
                assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want), what
                assert got.is_contiguous(), what
            elif case["kind"] == "split":
                assert_same_list(got, expected_split(case, rank, p), what)
            else:  # async: an equal and a split all-to-all in flight at once
                first, second = got
                assert torch.equal(first, expected_equal(case, rank, p)), what
                assert_same_list(second, expected_split(case, rank, p), what)


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"{w[0]}-p{w[1]}")
def test_bytes_and_messages_equal_the_formulas(runs, world):
    """Equal form: (p-1)/p of the input, p-1 messages; list form: every piece but the own
    one, plus one 8-byte count per peer unless recv_sizes was given."""
    _, p = world
    for i, case in enumerate(CASES):
        if case["kind"] not in ("equal", "split"):
            continue
        sent = []
        for rank in range(p):
            stats = runs[world][rank][i][1]
            sent.append(stats["bytes_sent"])
            if case["kind"] == "equal":
                t = workers.equal_input(case, rank, p)
                itemsize = t.element_size()
                assert stats["bytes_sent"] * p == (p - 1) * t.numel() * itemsize, (case, rank)
                assert stats["bytes_sent"] == cost_model.bytes_sent(
                    "all_to_all", p, rank, t.numel(), itemsize
                )
                assert stats["messages_sent"] == p - 1, (case, rank)
            else:
                pieces = workers.split_input(case, rank, p)
                mine = pieces[rank].numel() * pieces[rank].element_size()
                counts = 0 if case["given"] else 8 * (p - 1)
                total = sum(t.numel() * t.element_size() for t in pieces)
                assert stats["bytes_sent"] == total - mine + counts, (case, rank)
                row_bytes = math.prod(case["trailing"]) * pieces[0].element_size()
                rows = workers.split_rows(case, rank, p)
                assert stats["bytes_sent"] == cost_model.all_to_all_split_bytes(
                    rows, rank, row_bytes, case["given"]
                )
                assert stats["messages_sent"] == (p - 1) * (1 if case["given"] else 2), (case, rank)
        received = sum(runs[world][rank][i][1]["bytes_received"] for rank in range(p))
        assert received == sum(sent), case


def test_cost_model_time_formula_by_hand():
    model = cost_model.AlphaBeta(alpha=1e-5, beta=1e-9)
    assert cost_model.predict("all_to_all", 4, 4e6, model) == pytest.approx(3 * (1e-5 + 1e-3))
    assert cost_model.predict("all_to_all", 1, 4e6, model) == 0.0
    assert "all_to_all" not in cost_model.ALGORITHMS  # never chosen for an allreduce


@pytest.mark.parametrize(
    "transport, per_rank, odd",
    [
        ("shm", ["split", "split_int"], 1),  # different dtypes in the list form
        ("shm", ["equal", "split"], 1),  # the two forms
        ("pipe", ["equal", "equal", "allgather"], 2),  # another collective
        ("pipe", ["split_wrong_sizes", "split_wrong_sizes"], 1),  # recv_sizes that are wrong
    ],
)
def test_ranks_that_disagree_get_a_mismatch_naming_them(transport, per_rank, odd):
    """The launch timeout turns a hang into LaunchTimeout, which fails this test."""
    with pytest.raises(md.WorkerError) as info:
        md.launch(workers.disagreeing, len(per_rank), args=(per_rank,), transport=transport, timeout=60)
    assert info.value.exc_type == "MessageMismatch", str(info.value)
    assert f"rank {odd}" in info.value.summary, str(info.value)
    assert "all_to_all" in info.value.summary or "allgather" in info.value.summary


def test_bad_arguments_are_refused_before_any_message():
    from minidist.transport import ShmComm, share_with_rank
    from minidist.transport.shm_layout import allocate_mailboxes

    comm = ShmComm(0, 2, share_with_rank("shm", allocate_mailboxes(2, chunk=4096, slots=2), 0, 2))
    try:
        with pytest.raises(ValueError, match=r"reshape it to \(2, ...\)"):
            md.all_to_all(comm, torch.ones(3, 2))
        with pytest.raises(ValueError, match="reshape"):
            md.all_to_all(comm, torch.tensor(1.0))
        with pytest.raises(ValueError, match="reshape"):  # async: still checked in the caller's thread
            md.all_to_all(comm, torch.ones(3, 2), async_op=True)
        with pytest.raises(ValueError, match="one tensor per rank"):
            md.all_to_all(comm, [torch.ones(2)], async_op=True)
        with pytest.raises(ValueError, match="one tensor per rank"):
            md.all_to_all(comm, [torch.ones(2)])
        with pytest.raises(ValueError, match="same trailing shape"):
            md.all_to_all(comm, [torch.ones(2, 3), torch.ones(2, 4)])
        with pytest.raises(ValueError, match="same trailing shape"):
            md.all_to_all(comm, [torch.ones(2), torch.ones(2, dtype=torch.int64)])
        with pytest.raises(ValueError, match="0-dim"):
            md.all_to_all(comm, [torch.tensor(1.0), torch.tensor(2.0)])
        with pytest.raises(ValueError, match=r"recv_sizes\[0\]=1"):
            md.all_to_all(comm, [torch.ones(2), torch.ones(2)], recv_sizes=[1, 2])
        with pytest.raises(ValueError, match="2 counts"):
            md.all_to_all(comm, [torch.ones(2), torch.ones(2)], recv_sizes=[2])
        with pytest.raises(ValueError, match="list form"):
            md.all_to_all(comm, torch.ones(2, 2), recv_sizes=[2, 2])
        with pytest.raises(TypeError, match="expects a torch.Tensor"):
            md.all_to_all(torch.ones(2, 2), comm)
        assert comm.stats.messages_sent == 0
    finally:
        comm.close()
