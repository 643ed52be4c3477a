"""Assignment 9's trusted side, without launching anything: the reference's outer step and schedule
against the library's (two implementations of lecture 11's rules), its replay against the library's
``elastic.replay`` bit for bit, the simulation against the solution on one worker, the measured run's
levels (data parallel misses the target, the paper's DiLoCo lands in the second tier, the solution's
design in the first), the drawn cases (fragments in flight together, averages pending at the end,
kills that cost a contributor), and the intake's refusals. The examples through the pipeline:
``tests/grader/batches/test_a9.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from grader import forbidden
from grader.a9_resilient import cases, reference, workers
from grader.a9_resilient.grading import ASSIGNMENT
from minidist.parallel import elastic, local_sgd

ROOT = Path(__file__).resolve().parents[2]


def solution_module():
    spec = importlib.util.spec_from_file_location(
        "a9_solution_resilient", ROOT / "solutions" / "a9_resilient" / "resilient.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_outer_step_and_schedule_are_the_librarys():
    spec = cases.outer_spec(3)
    for index, problem in enumerate(spec["outer"]):
        n = problem["numel"]
        theta, v = workers.draw([n], spec["seed"], index, 0), torch.zeros(n, dtype=torch.float64)
        for r in range(problem["rounds"]):
            delta = workers.draw([n], spec["seed"], index, r + 1)
            local_sgd.nesterov_outer_step_(theta, v, delta, *problem["lr_mu"])
        want_theta, want_v = reference.outer_rounds(spec, index)
        assert torch.allclose(theta, want_theta, atol=1e-12) and torch.allclose(v, want_v, atol=1e-12)
    for h, f, steps in spec["schedules"] + [[4, 2, 10], [7, 7, 15]]:
        assert reference.schedule_table(h, f, steps) == [
            local_sgd.fragments_due(t, h, f) for t in range(1, steps + 1)
        ]


def test_the_reference_replay_is_the_librarys_bit_for_bit():
    spec = cases.quorum_spec(2, 5, False)
    history = [[0, 1, 2], [0, 2], [0, 1, 2], [1, 2], [0, 1, 2], [0, 1, 2]]

    def make_model():
        model = workers.quorum_model(spec)
        return model, workers.MomentumSGD(model.parameters(), spec["lr"], spec["mu"])

    model, optimizer = elastic.replay(
        history, make_model, lambda m, slot, step: workers.quorum_loss(m, spec, slot, step)
    )
    params, buffers = reference.replay(spec, history)
    assert all(torch.equal(a, b.detach()) for a, b in zip(params, model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(buffers, optimizer.state_dict()["buffers"], strict=True))
    other, _ = reference.replay(spec, [[0, 1, 2]] * 6)  # the history matters: the check can fail
    assert not torch.equal(other[0], params[0])


class OneWorker:
    """A communicator of one worker: the average of one delta is itself."""

    rank, world_size = 0, 1


def test_the_simulation_of_one_worker_is_the_solutions_streaming_sync(monkeypatch):
    resilient = solution_module()
    monkeypatch.setattr(resilient.md, "allreduce", lambda comm, t, op: t.clone())
    spec = dict(cases.streaming_spec(1, 3, "overlap"), flush=True)
    params = workers.regression_params(spec)
    sync = resilient.StreamingSync(
        OneWorker(), params, spec["inner_steps"], spec["fragments"], spec["delay"], spec["mix"],
        spec["outer_lr"], spec["outer_momentum"],
    )  # fmt: skip
    want = reference.simulate(spec, 1)
    for t in range(1, spec["steps"] + 1):
        workers.inner_step(params, *workers.regression_batch(spec, 0, t), spec["inner_lr"])
        sync.after_inner_step()
        assert torch.allclose(
            torch.cat([p.reshape(-1) for p in params]), want["trajectory"][0][t - 1], atol=1e-12
        )
    sync.flush()
    assert torch.allclose(torch.cat([p.reshape(-1) for p in params]), want["final"][0], atol=1e-12)


def measured_ms(design: dict) -> float | None:
    """The measured value of ``design`` from the simulation and the ring's counts (p = 2: a sync of n
    elements sends n x 8 bytes in 2 messages), or None when the target is not reached."""
    spec = dict(cases.MEASURED, **design, flush=False)
    out = reference.simulate(spec, 2)
    n, syncs, nbytes = out["final"][0].numel(), 0, 0
    for t in range(1, spec["steps"] + 1):
        for f in reference.due_at(design["inner_steps"], design["fragments"], t):
            syncs += 1
            nbytes += ((f + 1) * n // design["fragments"] - f * n // design["fragments"]) * 8
        if workers.heldout_loss(spec, 2, out["trajectory"][0][t - 1]) <= spec["target"]:
            return reference.emulated_ms(spec, t, nbytes, 2 * syncs)
    return None


def test_the_measured_levels_separate_the_designs():
    paper = {"fragments": 1, "delay": 0, "mix": 0.0, "outer_lr": 0.7, "outer_momentum": 0.9}
    ddp = {"inner_steps": 1, "fragments": 1, "delay": 0, "mix": 0.0, "outer_lr": 1.0, "outer_momentum": 0.0}
    (best, _), (second, _), (third, _) = cases.TIME_TIERS.levels
    assert measured_ms(ddp) is None  # data parallel does not reach the target in 200 steps
    assert best < measured_ms(dict(paper, inner_steps=50)) < second  # 14.288 ms
    assert best < measured_ms(dict(paper, inner_steps=10)) < second  # 15.216 ms
    assert round(measured_ms(solution_module().design()), 3) == 7.144 < best


def test_forged_or_missing_traffic_scores_no_better_than_the_designs_floor():
    """The reviewer's forgeries: counters patched to read 0, or a rank 0 that replays the other
    worker and sends nothing. The check scores max(counted, floor): each launch applied by step t
    costs its fragment's float64 values and one message -- the honest ring sends the same bytes in
    two messages, so a forgery gains the latency of one message a launch, nothing more."""
    design = solution_module().design()
    spec = dict(cases.MEASURED)
    run = reference.simulate(dict(spec, **design, flush=False), 2)
    reached = next(
        t
        for t, flat in enumerate(run["trajectory"][0], 1)
        if workers.heldout_loss(spec, 2, flat) <= spec["target"]
    )
    floor = reference.traffic_floor(spec, design)
    launches = reached // design["inner_steps"]  # F = 1, tau = 0: the whole model every H steps
    assert floor[reached - 1] == (8 * 600 * launches, launches)
    zeros = [[0, 0]] * spec["steps"]
    outs = [{"design": design, "trajectory": run["trajectory"][0], "traffic": zeros}]
    forged = reference.check_measured(spec, 2)(outs)
    assert forged == pytest.approx(measured_ms(design) - 0.5 * launches)  # 7.144 ms less 1 message a launch
    falling = [[100, 2]] * 10 + [[0, 0]] * (spec["steps"] - 10)
    with pytest.raises(AssertionError, match="counters fell"):
        reference.check_measured(spec, 2)([dict(outs[0], traffic=falling)])
    huge = dict(design, inner_steps=10**9, fragments=10**9)
    with pytest.raises(AssertionError, match="inner_steps <= 200"):
        reference.check_measured(spec, 2)([dict(outs[0], design=huge)])


def test_the_drawn_cases_cover_what_the_librarys_tests_miss():
    for seed in range(5):
        overlap = cases.streaming_spec(seed, 3, "overlap")
        assert overlap["fragments"] * overlap["delay"] > overlap["inner_steps"]  # several in flight
        pending = cases.streaming_spec(seed, 4, "pending")
        assert pending["flush"] and reference.simulate(dict(pending, flush=False), 2)["pending_at_end"] > 0
        kills = cases.quorum_spec(seed, 5, False)
        assert kills["kills"][0][2] in ("before_allreduce", "mid_exchange")  # a contributor is lost
        large = cases.quorum_spec(seed, 6, True)
        assert large["inputs"] * large["outputs"] * 8 > 2**20  # over a pipe's buffer


def test_intake_refuses_the_library_and_torchs_sgd():
    rules = ASSIGNMENT.forbidden
    refused = {
        "import torch\ntorch.optim.SGD([], lr=1.0)\n": "torch.optim.SGD",
        "from torch.optim.sgd import sgd\n": "torch.optim.sgd.sgd",
        "from minidist.parallel import local_sgd\n": "local_sgd",
        "from minidist.parallel.elastic.step import exchange\n": "exchange",
        "from minidist.parallel import elastic\nelastic.average_in_order([])\n": "average_in_order",
        "from minidist.parallel import elastic\nelastic.replay([], None, None)\n": "replay",
        "import torch\ntorch._fused_sgd_\n": "_fused_sgd_",
        "import torch.distributed\n": "torch.distributed",
    }
    for source, name in refused.items():
        refusal = forbidden.check(source, rules)
        assert refusal is not None and name in str(refusal), source
    assert forbidden.check("import minidist as md\nmd.allreduce\n", rules) is None
    assert forbidden.check((ROOT / "solutions" / "a9_resilient" / "resilient.py").read_text(), rules) is None
