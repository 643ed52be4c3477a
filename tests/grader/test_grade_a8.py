"""Assignment 8's trusted side, without launching anything: the reference router against the
solution's, against a hand-worked priority example and against the library's router (one rule for
both), the reference mixture against the solution's one-process layer, the measured levels of the
fixed layer (the three layouts' formulas), the seeded layers that must drop do, and the intake's
refusals. The examples through the pipeline: ``tests/grader/batches/test_a8.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from grader import forbidden
from grader.a8_experts import cases, reference, workers
from grader.a8_experts.grading import ASSIGNMENT
from minidist.parallel.experts import route as library_route

ROOT = Path(__file__).resolve().parents[2]


def solution_module():
    spec = importlib.util.spec_from_file_location(
        "a8_solution_experts", ROOT / "solutions" / "a8_experts" / "experts.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_router_keeps_the_earlier_token_first():
    # C = ceil(0.5 * 3 * 2 / 3) = 1: token 0's second choice (expert 1) keeps its place against
    # token 1's first choice; token 2's first choice finds expert 0 taken by token 0's
    logits = torch.tensor([[3.0, 2.0, 0.0], [2.0, 3.0, 0.0], [3.0, 0.0, 2.0]], dtype=torch.float64)
    chosen, gates, slots = reference.route(logits, 2, 0.5)
    assert chosen.tolist() == [[0, 1], [1, 0], [0, 2]]
    assert slots.tolist() == [[0, 0], [-1, -1], [-1, 0]]
    assert torch.allclose(gates.sum(1), torch.ones(3, dtype=torch.float64))


def test_the_reference_router_keeps_and_drops_what_the_librarys_does():
    # the lecture's library and the assignment's grader state one priority rule; two independent
    # implementations of it must agree on which choices survive an over-full expert
    for top_k, factor in ((1, 0.5), (2, 0.75), (3, 0.5), (2, 1.0)):
        for seed in range(3):
            g = torch.Generator().manual_seed(100 * top_k + seed)
            logits = torch.randn(16, 6, generator=g, dtype=torch.float64) * 3
            chosen, gates, slots = reference.route(logits, top_k, factor)
            library = library_route(logits, top_k, factor)
            assert torch.equal(chosen, library.experts)
            assert (slots < 0).any(), (top_k, factor, seed)  # over capacity: the rule decides
            assert torch.equal(slots >= 0, library.kept), (top_k, factor, seed)
            assert torch.allclose(gates, library.gates, atol=1e-12)


def test_the_reference_router_and_mixture_are_the_solutions():
    experts = solution_module()
    spec = cases.routing_spec(3)
    for index, problem in enumerate(spec["problems"]):
        logits = workers.draw([problem["tokens"], problem["experts"]], "float64", 5, index) * 3
        for got, want in zip(
            experts.route(logits, problem["top_k"], problem["capacity_factor"]),
            reference.route(logits, problem["top_k"], problem["capacity_factor"]),
        ):
            assert torch.allclose(got.double(), want.double(), atol=1e-12)
    layer = cases.layer_spec(0, 6, 4, 1.0, starve=True)
    router, all_experts = workers.make_router(layer), workers.make_experts(layer)
    x = workers.tokens(layer, 0)
    want = reference.mixture(x, router, all_experts, layer["top_k"], layer["capacity_factor"])
    chosen, gates, slots = experts.route(router(x), layer["top_k"], layer["capacity_factor"])
    c = experts.capacity(layer["tokens"], layer["top_k"], layer["experts"], layer["capacity_factor"])
    buffer = experts.dispatch(x, chosen, slots, layer["experts"], c)
    out = torch.stack([expert(buffer[e]) for e, expert in enumerate(all_experts)])
    assert torch.allclose(experts.combine(out, chosen, slots, gates), want, atol=1e-12)


def test_the_measured_layer_separates_the_three_layouts():
    levels = reference.levels(cases.MEASURED, cases.MEASURED_RANKS)
    # padded: 4 (p-1)/p E C / T with C = T; the other two counted from the fixed routing
    assert levels == {"padded": 16.0, "routed": 7.3125, "once per rank": 3.875}
    tiers = cases.BYTES_TIERS.levels
    assert (
        levels["once per rank"]
        < tiers[0][0]
        < levels["routed"]
        < tiers[1][0]
        < levels["padded"]
        < tiers[2][0]
    )
    assert reference.dropped(cases.MEASURED, cases.MEASURED_RANKS) == 0


def test_the_seeded_layers_with_a_capacity_drop_choices():
    for seed in range(10):
        starving = cases.layer_spec(seed, 6, 4, 1.0, starve=True)
        assert reference.dropped(starving, 4) > 0 and reference.starved(starving, 4)
        assert reference.dropped(cases.layer_spec(seed, 5, 2, None), 2) == 0


def test_the_byte_checks_want_exactly_the_formula():
    spec = cases.equal_spec(0)
    inputs = [[workers.equal_input(spec, i, r, 3) for r in range(3)] for i in range(len(spec["pieces"]))]
    outs = []
    for rank in range(3):
        outs.append(
            {
                "outs": [torch.stack([rows[i][rank] for i in range(3)]) for rows in inputs],
                "inputs_after": [rows[rank] for rows in inputs],
                "traffic": [[2 * rows[rank][0].numel() * rows[rank].element_size(), 2] for rows in inputs],
            }
        )
    reference.check_equal(spec, 3)(outs)
    outs[1]["traffic"][0][0] += 8  # one int64 more than (p-1)/p of the input
    with pytest.raises(pytest.fail.Exception, match="the transport carried"):
        reference.check_equal(spec, 3)(outs)


def test_the_intake_refuses_the_librarys_all_to_all_experts_and_ulysses():
    rules = ASSIGNMENT.forbidden
    for source in (
        "import minidist as md\ndef f(comm, x):\n    return md.all_to_all(comm, x)\n",
        "from minidist.collectives import all_to_all\n",
        "from minidist.parallel.experts import ExpertParallelMoE\n",
        "from minidist.parallel.experts.routing import route\n",
        "from minidist.parallel.context.ulysses import AllToAll\n",
        "import torch.distributed as dist\n",
        "import torch\nx = torch.ones(2).share_memory_()\n",
    ):
        assert forbidden.check(source, rules), source
    assert forbidden.check((ROOT / "solutions" / "a8_experts" / "experts.py").read_text(), rules) is None
