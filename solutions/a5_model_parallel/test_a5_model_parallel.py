"""Public tests of assignment 5. Run them from this folder with

    python -m pytest -q test_a5_model_parallel.py

Tasks 1-3 run your layers on 2 ranks (``a5_run.py``; your modules are imported in the worker
processes) against the dense MLP in this process; task 4's schedules are checked in this
process; task 5 runs your stage step on 2 ranks against the same model in one process. The
grader runs more: other sizes and degrees, every shard's gradient, the exact number of
allreduces and messages, a brute-force check of your 1F1B, its bubble and its memory, the stage
step on 4 stages with the grader's own stage modules, and your ``fast_schedule`` run by your
``run_stage`` on 4 stages, timed from the order its stages ran (graded in tiers).
"""

from __future__ import annotations

import a5_run
import pytest
import torch
from schedule import fast_schedule, gpipe, one_f_one_b
from tp_layers import ColumnParallelLinear, RowParallelLinear, shard_range

import minidist as md

D, FFN = 8, 16


def run(function, ranks, *args):
    """``function`` on ``ranks`` ranks; failures become messages that say what to do."""
    try:
        return a5_run.launch(function, ranks, *args)
    except md.WorkerError as error:
        if error.exc_type == "NotImplementedError":
            failure = f"rank {error.rank} raised {error.summary}\n-> fill in that TODO"
        else:
            failure = f"the run failed: {error}"
    except md.LaunchTimeout as error:
        failure = f"the run did not finish (a deadlock? a missing send or recv?): {error}"
    pytest.fail(failure, pytrace=False)


def dense_reference():
    mlp = a5_run.dense_mlp(D, FFN)
    x = a5_run.mlp_input(D).requires_grad_()
    out = mlp(x)
    out.pow(2).sum().backward()
    return mlp, x, out.detach()


# --- tasks 1-3 ------------------------------------------------------------------------------------
def test_parallel_mlp_equals_the_dense_mlp_on_two_ranks():
    reports = run(a5_run.tp_mlp, 2, D, FFN)
    mlp, x, out = dense_reference()
    for rank, report in enumerate(reports):
        assert torch.allclose(report["out"], out, atol=1e-6), f"rank {rank}: the output differs"
        assert torch.allclose(report["x_grad"], x.grad, atol=1e-6), f"rank {rank}: the input's gradient"
        start, stop = shard_range(FFN, _Rank(rank))
        grads = report["grads"]
        assert torch.allclose(grads["up.weight"], mlp.up.weight.grad[start:stop], atol=1e-6), rank
        assert torch.allclose(grads["up.bias"], mlp.up.bias.grad[start:stop], atol=1e-6), rank
        assert torch.allclose(grads["down.weight"], mlp.down.weight.grad[:, start:stop], atol=1e-6), rank
        assert torch.allclose(grads["down.bias"], mlp.down.bias.grad, atol=1e-6), rank


def test_parallel_mlp_allreduces_once_forward_and_once_backward():
    for rank, report in enumerate(run(a5_run.tp_mlp, 2, D, FFN)):
        assert tuple(report["allreduces"]) == (1, 1), (
            f"rank {rank}: (forward, backward) = {report['allreduces']}"
        )


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="10"):
        ColumnParallelLinear(8, 10, _Rank(0, 4))  # d_out = 10 on 4 ranks
    with pytest.raises(ValueError, match="6"):
        RowParallelLinear(6, 8, _Rank(0, 4))  # d_in = 6 on 4 ranks


class _Rank:
    def __init__(self, rank: int, world_size: int = 2) -> None:
        self.rank, self.world_size = rank, world_size


# --- task 4 ---------------------------------------------------------------------------------------
in_flight_peaks = a5_run.held


def test_one_f_one_b_has_every_action_once_and_holds_p_minus_r():
    p, m = 4, 6
    schedule = one_f_one_b(p, m)
    assert len(schedule) == p
    for actions in schedule:
        assert sorted(actions) == sorted(gpipe(1, m)[0])  # each F and B once
        for kind, j in actions:  # no backward before its forward
            if kind == "B":
                assert actions.index(("F", j)) < actions.index(("B", j))
    assert in_flight_peaks(schedule) == [4, 3, 2, 1]  # GPipe's would be [6, 6, 6, 6]
    assert schedule[-1][:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_one_f_one_b_with_fewer_microbatches_than_stages():
    assert in_flight_peaks(one_f_one_b(4, 2)) == [2, 2, 2, 1]


def test_your_schedule_is_valid_within_the_cap_and_beats_1f1b():
    p, m = 4, 8  # what the grader measures (on the order your run_stage runs it)
    schedule = fast_schedule(p, m)
    assert len(schedule) == p
    for r, actions in enumerate(schedule):
        for kind in ("F", "B"):  # once each, in microbatch order
            assert [j for k, j in actions if k == kind] == list(range(m)), f"stage {r}: the {kind}s"
        weights = [j for k, j in actions if k == "W"]
        assert sorted(weights) == sorted(set(weights)) and set(weights) <= set(range(m)), f"stage {r}: Ws"
    assert max(in_flight_peaks(schedule)) <= p, f"held {in_flight_peaks(schedule)}: the cap is p = {p}"
    _, fast = a5_run.timeline(schedule)
    _, baseline = a5_run.timeline(one_f_one_b(p, m))
    assert fast < baseline, f"{fast:.4g}x of the ideal, 1F1B {baseline:.4g}x: no faster"


# --- task 5 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "split-gpipe"])
def test_stage_step_gradients_equal_one_process(kind):
    m, rows, width, classes = 3, 4, 6, 3
    reports = run(a5_run.pipeline, 2, m, rows, width, classes, kind)
    loss, grads = a5_run.one_process(2, m, rows, width, classes)
    assert reports[0]["loss"] is None and abs(reports[1]["loss"] - loss) < 1e-5
    for rank, report in enumerate(reports):
        for got, want in zip(report["grads"], grads[rank], strict=True):
            assert torch.allclose(got, want, atol=1e-6), f"stage {rank}: a gradient differs"
        assert report["messages"] == m, f"stage {rank}: {report['messages']} messages for {m} microbatches"
    assert [r["peak"] for r in reports] == ([2, 1] if kind == "1f1b" else [m, m])


def test_stage_step_runs_your_fast_schedule():
    m, rows, width, classes = 5, 4, 6, 3
    reports = run(a5_run.pipeline, 2, m, rows, width, classes, "fast")
    loss, grads = a5_run.one_process(2, m, rows, width, classes)
    assert reports[0]["loss"] is None and abs(reports[1]["loss"] - loss) < 1e-5
    for rank, report in enumerate(reports):
        for got, want in zip(report["grads"], grads[rank], strict=True):
            assert torch.allclose(got, want, atol=1e-6), f"stage {rank}: a gradient differs"
    assert [r["peak"] for r in reports] == in_flight_peaks(fast_schedule(2, m))
