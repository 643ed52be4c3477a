"""Elastic data parallelism: ranks SIGKILLed at every point of the step, replacements recovered
from a healthy peer, and the result bit-for-bit a one-process replay of the membership history.

One launch (4 slots, 12 steps, Policy(min_size=2, max_restarts=7)) kills nine processes
(slot.incarnation; incarnation 0 started with the launch, k its k-th replacement):

    step 2  1.0  in the middle of the gradient exchange (after its first send)    -> replaced
    step 3  0.0  as the donor, in the middle of sending the state to 1.1          -> replaced
            0.1  while it is being recovered                                      -> replaced
    step 4  3.0  after its report, before the commit: it counts                   -> replaced
            3.1  at startup, before its first ask (the quorum waits for it)       -> replaced
    step 5  3.2  part-way through receiving the 2 MiB state (the donor's write breaks) -> replaced
    step 6  3.3  after the exchange (its gradient reached everyone)     -> replaced (the last)
    step 8  2.0  after asking, before the quorum's answer: no restarts left
    step 9  3.4  before the exchange: training ends at 2 = min_size

The expected history is derived by hand from those rules in ``EXPECTED``; detection "within
the step" means exactly that the history changes at the step of each death (and that the commit
of that step reaches the survivors after the death: ``test_a_death_is_detected_within_its_step``).
The kill "after_ask" is put where no restart is left: a replacement would join at that step or
the next depending on whether the coordinator saw the ask or the death first (a race).
"""

from __future__ import annotations

import os

import pytest
import torch

import elastic_workers as ew
import minidist as md
from minidist.errors import LaunchTimeout, WorkerError
from minidist.parallel import elastic

pytestmark = pytest.mark.timeout(120)

STEPS = 12
KILLS = {
    (1, 0): ("mid_allreduce", 2),
    (0, 0): ("donor_mid_send", 3),
    (0, 1): ("joiner_recovering", 3),
    (3, 0): ("after_report", 4),
    (3, 1): ("startup", -1),
    (3, 2): ("joiner_mid_recv", 5),
    (3, 3): ("after_allreduce", 6),
    (2, 0): ("after_ask", 8),
    (3, 4): ("before_allreduce", 9),
}
ALL = [0, 1, 2, 3]
EXPECTED = [ALL, ALL, [0, 2, 3], ALL, ALL, ALL, ALL, ALL, [0, 1, 3], [0, 1], [0, 1], [0, 1]]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pid_dir = str(tmp_path_factory.mktemp("pids"))
    outs = md.launch(
        ew.elastic_worker,
        world_size=4,
        args=(STEPS, KILLS, pid_dir),
        transport="pipe",
        timeout=60,
        elastic=elastic.Policy(min_size=2, max_restarts=7),
    )
    return outs, pid_dir


def assert_no_process_left(pid_dir) -> None:
    """Every process the launch started (each wrote ``<slot>.<incarnation>.pid``) is gone."""
    for name in (n for n in os.listdir(pid_dir) if n.endswith(".pid")):
        with pytest.raises(ProcessLookupError):
            os.kill(int(open(os.path.join(pid_dir, name)).read()), 0)


def replay(history):
    return elastic.replay(history, ew.make_model, ew.loss_of)


def test_history_follows_the_deaths_and_the_joins(run):
    outs, _ = run
    assert [o and o["incarnation"] for o in outs[:2]] == [2, 1]  # slot 0 replaced twice, slot 1 once
    assert outs[2] is None and outs[3] is None  # died after the restarts were spent
    for out in outs[:2]:
        assert out["history"] == EXPECTED
    # recovery rounds: step 3: donor 0.0 died, 0.1 died recovering, 0.2 recovered (1.1: 3,
    # 0.2: 1); step 5: 3.2 died receiving, 3.3 recovered; step 7: 3.4 recovered (3 more each)
    assert outs[1]["recoveries"] == 6 and outs[0]["recoveries"] == 4
    assert outs[0]["recovered_bytes"] > 2 * 8 * ew.PAD // 2  # the state: over a 1 MiB pipe buffer


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
    names = sorted(n for n in os.listdir(pid_dir) if n.endswith(".pid"))
    assert names == [f"{slot}.{i}.pid" for slot, last in enumerate((2, 1, 0, 4)) for i in range(last + 1)]
    assert_no_process_left(pid_dir)


def test_a_death_is_detected_within_its_step(run):
    """Each death in a training round before its report: every survivor's commit of that step
    (whose history entry is checked above) arrives after the kill -- the step waited for the
    death, no longer. The seconds from the SIGKILL to each survivor's commit are printed (-s):
    a measurement, not a bound (it depends on the load)."""
    _, pid_dir = run
    commits = {}  # (slot, incarnation) -> {step: when its commit arrived}
    for name in os.listdir(pid_dir):
        if name.endswith(".commits"):
            slot, inc = map(int, name.split(".")[:2])
            words = open(os.path.join(pid_dir, name)).read().split()
            commits[(slot, inc)] = {int(a): float(b) for a, b in zip(words[::2], words[1::2])}
    seen = []
    for (slot, inc), (point, step) in KILLS.items():
        killed = float(open(os.path.join(pid_dir, f"{slot}.{inc}.killed")).read())
        if point not in ("after_ask", "before_allreduce", "mid_allreduce", "after_allreduce"):
            continue  # a recovery round commits no step; after_report: the commit may come first
        survivors = [t[step] for who, t in commits.items() if who != (slot, inc) and step in t]
        assert len(survivors) == len(EXPECTED[step]) - (slot in EXPECTED[step])
        assert all(t > killed for t in survivors)
        seen += [t - killed for t in survivors]
    print(f"SIGKILL -> survivors' commit: {len(seen)} in {min(seen) * 1e3:.1f}-{max(seen) * 1e3:.1f} ms")


def test_below_min_size_fails_cleanly(tmp_path):
    kills = {(1, 0): ("before_allreduce", 1)}
    with pytest.raises(elastic.ElasticError, match="min_size=2"):
        md.launch(
            ew.elastic_worker, world_size=2, args=(4, kills, str(tmp_path)), transport="pipe",
            timeout=60, elastic=elastic.Policy(min_size=2),
        )  # fmt: skip
    assert_no_process_left(tmp_path)


def test_a_rank_alive_but_stuck_is_not_detected_the_launch_times_out(tmp_path):
    """Only deaths are detected (end-of-file); a stuck rank keeps its pipes open, its peer waits
    for its gradient and the coordinator for its report: md.launch's timeout ends the run."""
    kills = {(1, 0): ("hang:before_allreduce", 1)}
    with pytest.raises(LaunchTimeout) as caught:
        md.launch(
            ew.elastic_worker, world_size=2, args=(3, kills, str(tmp_path)), transport="pipe",
            timeout=2, elastic=elastic.Policy(min_size=1),
        )  # fmt: skip
    stacks = caught.value.stacks  # rank 1 sleeps in on_point, rank 0 waits in the exchange
    assert caught.value.ranks == [0, 1] and "in on_point" in stacks[1] and "in _exchange" in stacks[0]
    assert_no_process_left(tmp_path)


def test_with_a_step_timeout_a_stuck_rank_is_killed_and_training_goes_on(tmp_path):
    """Policy(step_timeout=1): slot 2 hangs before its exchange at step 1 -- slots 0 and 1 give
    up on its gradient after 1 s and report, the coordinator kills it 1 s after their reports, a
    replacement recovers; slot 1 hangs after the commit of step 3 -- the others ask for step 4,
    it is killed 1 s later, no restart is left. The history as derived, equal to the replay."""
    kills = {(2, 0): ("hang:before_allreduce", 1), (1, 0): ("hang:after_report", 3)}
    policy = elastic.Policy(min_size=2, max_restarts=1, step_timeout=1.0)
    outs = md.launch(
        ew.elastic_worker, world_size=3, args=(6, kills, str(tmp_path)), transport="pipe",
        timeout=60, elastic=policy,
    )  # fmt: skip
    three = [0, 1, 2]
    expected = [three, [0, 1], three, three, [0, 2], [0, 2]]
    assert outs[1] is None and outs[2]["incarnation"] == 1
    model, _ = replay(expected)
    for out in (outs[0], outs[2]):
        assert out["history"] == expected
        for got, ref in zip(out["params"], model.parameters(), strict=True):
            assert torch.equal(got, ref.detach())
    assert_no_process_left(tmp_path)
    hung = float(open(tmp_path / "2.0.hung").read())
    commit = float(open(tmp_path / "0.0.commits").read().split()[3])  # step 1's
    print(f"hang -> survivors' commit of that step: {commit - hung:.2f} s (step_timeout 1 s)")


def test_with_a_start_timeout_a_replacement_stuck_in_its_setup_is_killed(tmp_path):
    """Policy(start_timeout=3): slot 1 dies in step 1's exchange; its replacement 1.1 hangs before
    its first ask (setup), which no step_timeout sees (it is not a member yet) and the quorum
    waits for; it is killed 3 s after its start, 1.2 recovers and training goes on at 3."""
    kills = {(1, 0): ("mid_allreduce", 1), (1, 1): ("hang:startup", -1)}
    policy = elastic.Policy(min_size=2, max_restarts=2, start_timeout=3.0)
    outs = md.launch(
        ew.elastic_worker, world_size=3, args=(4, kills, str(tmp_path)), transport="pipe",
        timeout=60, elastic=policy,
    )  # fmt: skip
    three = [0, 1, 2]
    expected = [three, [0, 2], three, three]
    assert outs[1]["incarnation"] == 2 and outs[1]["recoveries"] == 1
    model, _ = replay(expected)
    for out in outs:
        assert out["history"] == expected
        for got, ref in zip(out["params"], model.parameters(), strict=True):
            assert torch.equal(got, ref.detach())
    assert_no_process_left(tmp_path)
    hung = float(open(tmp_path / "1.1.hung").read())
    lines = [line.split() for line in open(tmp_path / "0.0.commits").read().splitlines()]
    commit = max(float(when) for step, when in lines if step == "2")  # step 2's training round
    print(f"stuck start -> the next training step's commit: {commit - hung:.2f} s (start_timeout 3 s)")


def test_bad_uses_say_what_to_do():
    with pytest.raises(ValueError, match="transport='pipe'"):
        md.launch(ew.elastic_worker, world_size=2, transport="shm", elastic=elastic.Policy())
    with pytest.raises(ValueError, match="min_size"):
        elastic.Policy(min_size=0)
    with pytest.raises(ValueError, match="step_timeout"):
        elastic.Policy(step_timeout=0)
    with pytest.raises(ValueError, match="start_timeout"):
        elastic.Policy(start_timeout=float("nan"))
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


def test_a_parameter_without_a_gradient_is_refused_with_what_to_do():
    with pytest.raises(WorkerError, match="got no gradient.*requires_grad=False"):
        md.launch(
            ew.unused_parameter_worker, world_size=2, transport="pipe", timeout=60,
            elastic=elastic.Policy(min_size=2),
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
