"""Elastic data parallelism: ranks SIGKILLed at every point of the step, replacements recovered
from a healthy peer, and the result bit-for-bit a one-process replay of the membership history.

One launch (4 slots, 10 steps, Policy(min_size=2, max_restarts=3)) kills five ranks:

    step 2  slot 1     in the middle of the gradient exchange (after its first send) -> replaced
    step 3  slot 0     as the donor, in the middle of sending the state to slot 1's replacement
    step 3  slot 0'    (0's replacement) while it is being recovered       -> replaced again
    step 5  slot 3     after the exchange (its gradient reached everyone): no restarts left
    step 7  slot 2     before the exchange: training ends at 2 = min_size

The expected history is derived by hand from those rules in ``EXPECTED``; detection "within
the step" means exactly that the history changes at the step of each death.
"""

from __future__ import annotations

import os

import pytest
import torch

import elastic_workers as ew
import minidist as md
from minidist.errors import WorkerError
from minidist.parallel import elastic

pytestmark = pytest.mark.timeout(120)

STEPS = 10
KILLS = {
    (1, 0): ("mid_allreduce", 2),
    (0, 0): ("donor_mid_send", 3),
    (0, 1): ("joiner_recovering", 3),
    (3, 0): ("after_allreduce", 5),
    (2, 0): ("before_allreduce", 7),
}
ALL = [0, 1, 2, 3]
EXPECTED = [ALL, ALL, [0, 2, 3], ALL, ALL, ALL, [0, 1, 2], [0, 1], [0, 1], [0, 1]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pid_dir = str(tmp_path_factory.mktemp("pids"))
    outs = md.launch(
        ew.elastic_worker,
        world_size=4,
        args=(STEPS, KILLS, pid_dir),
        transport="pipe",
        timeout=60,
        elastic=elastic.Policy(min_size=2, max_restarts=3),
    )
    return outs, pid_dir


def replay(history):
    """One process: at each step, the contributors' gradients added in slot order, / count."""
    model, optimizer = ew.make_model()
    params = list(model.parameters())
    for step, contributors in enumerate(history):
        grads = []
        for slot in contributors:
            model.zero_grad()
            ew.loss_of(model, slot, step).backward()
            grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / len(contributors)
        optimizer.step()
    return model, optimizer


def test_history_follows_the_deaths_and_the_joins(run):
    outs, _ = run
    assert [o and o["incarnation"] for o in outs[:2]] == [2, 1]  # slot 0 replaced twice, slot 1 once
    assert outs[2] is None and outs[3] is None  # died after the restarts were spent
    for out in outs[:2]:
        assert out["history"] == EXPECTED
    # recovery rounds at step 3: donor 0 died, then 0' died while recovering, then 0'' recovered
    assert outs[1]["recoveries"] == 3 and outs[0]["recoveries"] == 1


def test_survivors_equal_a_replay_of_the_history_bit_for_bit(run):
    outs, _ = run
    model, optimizer = replay(EXPECTED)
    want = optimizer.state_dict()
    for out in outs[:2]:
        for got, ref in zip(out["params"], model.parameters(), strict=True):
            assert torch.equal(got, ref.detach())
        assert out["optimizer"]["t"] == want["t"] == STEPS
        for got, ref in zip(
            out["optimizer"]["m"] + out["optimizer"]["v"], want["m"] + want["v"], strict=True
        ):
            assert torch.equal(got, ref)


def test_replay_tells_the_scaling_apart(run):
    """The check can fail: averaging step 2 over 4 ranks (or summing) gives other bits."""
    outs, _ = run
    model, _ = replay([ALL, ALL, ALL, *EXPECTED[3:]])
    assert not torch.equal(outs[0]["params"][0], next(model.parameters()).detach())


def test_no_process_is_left(run):
    _, pid_dir = run
    names = sorted(os.listdir(pid_dir))
    assert names == ["0.0.pid", "0.1.pid", "0.2.pid", "1.0.pid", "1.1.pid", "2.0.pid", "3.0.pid"]
    for name in names:
        pid = int(open(os.path.join(pid_dir, name)).read())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_below_min_size_fails_cleanly(tmp_path):
    kills = {(1, 0): ("before_allreduce", 1)}
    with pytest.raises(elastic.ElasticError, match="min_size=2"):
        md.launch(
            ew.elastic_worker, world_size=2, args=(4, kills, str(tmp_path)), transport="pipe",
            timeout=60, elastic=elastic.Policy(min_size=2),
        )  # fmt: skip
    for name in os.listdir(tmp_path):
        with pytest.raises(ProcessLookupError):
            os.kill(int(open(tmp_path / name).read()), 0)


def test_bad_uses_say_what_to_do():
    with pytest.raises(ValueError, match="transport='pipe'"):
        md.launch(ew.elastic_worker, world_size=2, transport="shm", elastic=elastic.Policy())
    with pytest.raises(ValueError, match="min_size"):
        elastic.Policy(min_size=0)
    with pytest.raises(ValueError, match="larger than world_size"):
        md.launch(ew.elastic_worker, world_size=2, transport="pipe", elastic=elastic.Policy(min_size=3))
    with pytest.raises(RuntimeError, match="elastic launch"):
        elastic.FaultTolerant(None, torch.nn.Linear(1, 1), None, 1)


def test_a_rank_that_raises_is_a_bug_not_a_lost_machine(tmp_path):
    with pytest.raises(WorkerError, match="AttributeError"):
        md.launch(
            ew.elastic_worker, world_size=2, args=(2, None, str(tmp_path)), transport="pipe",
            timeout=60, elastic=elastic.Policy(max_restarts=1),
        )  # fmt: skip


def test_without_waiting_the_survivors_go_on_and_still_equal_the_replay(tmp_path):
    """wait_for_replacements=False: when the replacement joins depends on timing, so the check is
    against a replay of the history the run recorded (whatever it is)."""
    kills = {(1, 0): ("mid_allreduce", 1)}
    policy = elastic.Policy(min_size=2, max_restarts=1, wait_for_replacements=False)
    outs = md.launch(
        ew.elastic_worker, world_size=3, args=(6, kills, str(tmp_path)), transport="pipe",
        timeout=60, elastic=policy,
    )  # fmt: skip
    history = outs[0]["history"]
    assert history[:2] == [[0, 1, 2], [0, 2]] and len(history) == 6
    assert all(c in ([0, 2], [0, 1, 2]) for c in history[2:])
    model, _ = replay(history)
    for out in (outs[0], outs[2]):
        assert out["history"] == history
        for got, ref in zip(out["params"], model.parameters(), strict=True):
            assert torch.equal(got, ref.detach())


def test_a_gradient_larger_than_a_pipe_buffer_is_exchanged_without_deadlock():
    # 400 x 400 float64 = 1.28 MB a gradient: blocking sends on both sides first would wait forever
    outs = md.launch(
        ew.large_gradient_worker,
        world_size=2,
        args=(400,),
        transport="pipe",
        timeout=60,
        elastic=elastic.Policy(min_size=2),
    )
    assert [out["history"] for out in outs] == [[[0, 1], [0, 1]]] * 2
    for step in range(2):  # both ranks applied the same average of both gradients
        assert torch.equal(outs[0]["grads"][step], outs[1]["grads"][step])
