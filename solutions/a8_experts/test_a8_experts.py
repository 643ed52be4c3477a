"""Public tests of assignment 8. Run them from this folder with

    python -m pytest -q test_a8_experts.py

``all_to_all`` on 3 ranks: equal pieces against the transpose they must give, and their bytes;
uneven pieces (one empty) against what each rank addressed to the other. ``route`` on two small
examples worked by hand from the rules of ``experts.py``. ``dispatch`` and ``combine`` with
experts that return their input. ``ExpertParallelMoE`` on 2 ranks (``a8_run``), with choices
dropped, against your own functions on one process (``a8_run.one_process``): output and every
gradient. The grader runs more: shapes, routers and capacity factors you have not seen, 3 and 4
ranks, the "pipe" transport, messages larger than a pipe's buffer, its own one-process reference,
and task 4's measured bytes.
"""

from __future__ import annotations

import functools

import experts
import pytest
import torch
from a8_run import Setup, exchange_worker, layer_worker, one_process, run

import minidist as md

TOLERANCE = 1e-9  # double precision: p ranks and one process differ by rounding only
SHAPE = (2, 5)
ROWS = [[1, 0, 2], [3, 1, 1], [0, 2, 4]]  # ROWS[i][j]: rows rank i sends to rank j
SETUP = Setup()


def launch(worker, setup, *args, what: str):
    try:
        return run(worker, setup, *args)
    except md.WorkerError as error:
        if error.exc_type == "NotImplementedError":
            failure = f"{what}: rank {error.rank} raised {error.summary}\n-> fill in that TODO in experts.py"
        else:
            failure = f"{what} failed: {error}"
    except md.LaunchTimeout as error:
        failure = f"{what} did not finish within 60 s (a deadlock?): {error}"
    pytest.fail(failure, pytrace=False)


@functools.cache
def exchanged() -> list[dict]:
    return launch(exchange_worker, Setup(ranks=3), SHAPE, ROWS, what="all_to_all")


@functools.cache
def layered() -> list[dict]:
    return launch(layer_worker, SETUP, what="ExpertParallelMoE")


def test_all_to_all_transposes_equal_pieces():
    for rank, out in enumerate(exchanged()):
        want = torch.stack(
            [torch.arange(3 * 10, dtype=torch.float64).view(3, *SHAPE)[rank] + 1000 * i for i in range(3)]
        )
        assert torch.equal(out["equal"], want), f"rank {rank}"
        # (p-1)/p of the input: its own piece is copied, not sent
        assert out["bytes"][0] == 2 * 10 * 8, f"rank {rank} sent {out['bytes'][0]} bytes"


def test_all_to_all_delivers_uneven_pieces():
    for rank, out in enumerate(exchanged()):
        assert len(out["uneven"]) == 3
        for i, piece in enumerate(out["uneven"]):
            assert torch.equal(piece, torch.full((ROWS[i][rank], 3), float(10 * i + rank))), (rank, i)
        pieces = sum(ROWS[rank][j] for j in range(3) if j != rank) * 3 * 4
        assert out["bytes"][1] == pieces + 2 * 8, "the pieces for the others, and one int64 size to each"


def test_route_keeps_the_earlier_token_first():
    # 3 tokens, 3 experts, top-2, capacity factor 0.5: C = ceil(0.5 * 3 * 2 / 3) = 1
    logits = torch.tensor([[3.0, 2.0, 0.0], [2.0, 3.0, 0.0], [3.0, 0.0, 2.0]], dtype=torch.float64)
    chosen, gates, slots = experts.route(logits, 2, 0.5)
    assert chosen.tolist() == [[0, 1], [1, 0], [0, 2]]
    # by position: token 0 takes expert 0's slot and expert 1's (its second choice is not pushed
    # out by token 1's first); token 1 finds both full; token 2 finds expert 0 full, takes expert 2's
    # (GShard's order, first choices first, would give [[0, -1], [0, -1], [-1, 0]])
    assert slots.tolist() == [[0, 0], [-1, -1], [-1, 0]]
    top = torch.softmax(torch.tensor([3.0, 2.0], dtype=torch.float64), 0)  # renormalised over the 2
    assert torch.allclose(gates, top.repeat(3, 1), atol=1e-12)


def test_route_with_one_expert_per_token_and_no_limit():
    logits = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [1.0, 0.0]], dtype=torch.float64)
    chosen, gates, slots = experts.route(logits, 1, None)
    assert chosen.tolist() == [[1], [0], [1], [0]] and slots.tolist() == [[0], [0], [1], [1]]
    assert torch.allclose(gates[:, 0], torch.softmax(logits, 1).max(1).values, atol=1e-12)  # k = 1: p itself


def test_dispatch_and_combine_with_identity_experts():
    torch.manual_seed(0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    chosen = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 0], [1, 0]])
    slots = torch.tensor([[0, 0], [1, 0], [1, -1], [1, -1], [-1, 2]])
    gates = torch.rand(5, 2, dtype=torch.float64)
    buffer = experts.dispatch(x, chosen, slots, 3, 3)
    assert buffer.shape == (3, 3, 3)
    assert torch.equal(buffer[0, 2], x[4].detach()) and torch.equal(
        buffer[2, 2], torch.zeros(3, dtype=torch.float64)
    )
    y = experts.combine(buffer, chosen, slots, gates)  # experts that return their input
    kept = torch.where(slots >= 0, gates, torch.zeros_like(gates)).sum(1, keepdim=True)
    assert torch.allclose(y, x * kept, atol=1e-12)
    y.sum().backward()
    # each token's gradient: its kept gates, once through dispatch and once through combine
    assert torch.allclose(x.grad, kept.expand(5, 3), atol=1e-12)


def test_layer_on_two_ranks_equals_your_one_process_layer():
    want = one_process(experts, SETUP)
    outs = layered()
    for rank, (out, ref) in enumerate(zip(outs, want)):
        for key in ("y", "x_grad", "router_grad"):
            assert out[key] is not None, f"rank {rank}: {key} is None"
            difference = (out[key] - ref[key]).abs().max().item()
            assert difference <= TOLERANCE, f"rank {rank}: {key} differs by {difference:.2g}"
        for got, wanted in zip(out["expert_grads"], ref["expert_grads"]):
            for g, w in zip(got, wanted):
                g = torch.zeros_like(w) if g is None else g
                assert (g - w).abs().max().item() <= TOLERANCE, f"rank {rank}: an expert's gradient"


def test_layer_sends_at_most_the_padded_layout():
    # GShard's layout sends (p-1)/p of the E x C slots in each of 4 exchanges (forward, backward)
    c = experts.capacity(SETUP.tokens, SETUP.top_k, SETUP.experts, SETUP.capacity_factor)
    padded = 4 * (SETUP.ranks - 1) / SETUP.ranks * SETUP.experts * c * SETUP.width * 8
    for rank, out in enumerate(layered()):
        assert 0 < out["bytes"] <= padded + 64, f"rank {rank} sent {out['bytes']} bytes, padded: {padded:.0f}"
