"""Stragglers: the deadline aggregator equals synchronous DDP without one, and with one
dropped applies exactly the average of the on-time ranks (a one-process reference that is
told which ranks contributed), discards every late push, and shuts down cleanly."""

from __future__ import annotations

import pytest
import torch

import averaging_workers as aw
import ddp_workers as w
import minidist as md
from minidist.parallel import stragglers

pytestmark = pytest.mark.timeout(240)


def _run(cfg, policy, slow, transport):
    n = cfg["world_size"]
    outs = md.launch(
        aw.train_drop_slowest, world_size=n + 1, args=(cfg, policy, slow), transport=transport, timeout=150
    )
    return outs[:n], outs[n]["report"]


@pytest.mark.parametrize("transport", ["shm", "pipe"])
def test_without_straggler_equals_synchronous_ddp(transport):
    cfg = w.config(world_size=3, steps=3, bucket_mb=w.SEVERAL_BUCKETS_MB)
    # wait for everyone unless someone is 60 s late: nobody is, so every round has all three
    workers, report = _run(cfg, stragglers.DeadlinePolicy(min_workers=1, deadline_s=60.0), None, transport)
    want = w.train_single(cfg)
    assert report.discarded == 0 and report.rounds == cfg["steps"] * 2
    for out in workers:
        assert out["contributors"] == [[0, 1, 2]] * report.rounds
        for name in want:
            torch.testing.assert_close(out["state"][name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("transport", ["shm", "pipe"])
def test_dropped_straggler_gradient_is_average_of_on_time_ranks(transport):
    cfg = w.config(world_size=3, steps=3, bucket_mb=float("inf"))  # one bucket: one round per step
    slow = stragglers.SlowRank(rank=2, delay_s=1.0, jitter_s=0.2, seed=7)
    workers, report = _run(cfg, stragglers.DeadlinePolicy(min_workers=2, deadline_s=0.0), slow, transport)
    masks = workers[0]["contributors"]
    assert len(masks) == cfg["steps"] and all(len(m) == 2 for m in masks)  # first 2 of 3
    assert all(out["contributors"] == masks for out in workers)  # every rank told the same
    assert [c for _, _, c in report.contributors] == masks
    assert report.discarded == cfg["steps"]  # each round's third push came late and was dropped
    assert any(2 not in m for m in masks)  # the rank that sleeps 1 s is the one left out
    want = aw.train_single_with_masks(cfg, masks)
    for out in workers:
        for name in want:
            torch.testing.assert_close(out["state"][name], want[name], rtol=1e-5, atol=1e-6)
    # and it is not what waiting for everyone gives
    everyone = w.train_single(cfg)
    assert any(not torch.allclose(workers[0]["state"][k], everyone[k]) for k in everyone)


def test_slow_rank_is_seeded_and_only_one_rank_sleeps():
    slow = stragglers.SlowRank(rank=1, delay_s=0.1, jitter_s=0.05, seed=3)
    assert slow.delay(0, 5) == 0.0
    assert slow.delay(1, 5) == stragglers.SlowRank(rank=1, delay_s=0.1, jitter_s=0.05, seed=3).delay(1, 5)
    assert 0.1 <= slow.delay(1, 5) < 0.15
    assert len({slow.delay(1, s) for s in range(5)}) == 5


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="min_workers"):
        stragglers.DeadlinePolicy(min_workers=0)
    with pytest.raises(ValueError, match="deadline_s"):
        stragglers.DeadlinePolicy(min_workers=1, deadline_s=-1.0)
