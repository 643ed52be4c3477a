"""The naive DDP (``parallel/ddp_naive.py``) against the bucketed one and against one process.

Ranks start from different random weights (the broadcast must fix that) and train with SGD
on their own slice of each batch; the single-process reference trains on the whole batch.
"""

from __future__ import annotations

import pytest
import torch

import ddp_naive_workers as nw
import ddp_workers as w
import minidist as md
from minidist.collectives import cost_model

pytestmark = pytest.mark.timeout(60)


def assert_states_equal(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def two_ranks():
    """One launch: the naive DDP (ring) and the bucketed DDP, 2 ranks on shm, 3 SGD steps."""
    cfg = w.config(world_size=2, steps=3, lr=0.1, bucket_mb=w.SEVERAL_BUCKETS_MB)
    return cfg, md.launch(nw.naive_and_bucketed, 2, args=(cfg,), transport="shm", timeout=60)


def test_naive_equals_bucketed_ddp(two_ranks):
    _, outs = two_ranks
    for out in outs:
        # p = 2: a + b and (a + b) / 2 are exact in any order, so both agree to the last bit
        assert_states_equal(out["state"], out["bucketed"], atol=1e-7)
    assert_states_equal(outs[0]["state"], outs[1]["state"], atol=0.0)


def test_naive_equals_one_process_with_the_whole_batch(two_ranks):
    cfg, outs = two_ranks
    reference = nw.train_single_sgd(cfg)
    for out in outs:
        assert_states_equal(out["state"], reference, atol=1e-6)


def test_traffic_is_one_ring_allreduce_per_parameter(two_ranks):
    _, outs = two_ranks
    p, numels = len(outs), outs[0]["numels"]
    for rank, out in enumerate(outs):
        # one allreduce per parameter, plus one of the used-flags (one float32 per parameter)
        want = sum(cost_model.bytes_sent("ring", p, rank, n, 4) for n in numels)
        want += cost_model.bytes_sent("ring", p, rank, len(numels), 4)
        assert out["sent"] == [want] * len(out["sent"])
    # summed over the ranks the ring sends 2(p-1) x every byte, whatever the chunk rounding
    total = 2 * (p - 1) * 4 * (sum(numels) + len(numels))
    assert sum(out["sent"][0] for out in outs) == total


def test_a_parameter_no_rank_used_keeps_no_gradient():
    # `extra` is unused on rank 0 in step 0 only; `unused` is never used by any rank
    cfg = w.config(world_size=2, steps=2, lr=0.1, unused=True, sometimes_used=True)
    outs = md.launch(nw.train_naive, 2, args=(cfg,), transport="shm", timeout=60)
    reference = nw.train_single_sgd(cfg)
    for out in outs:
        assert_states_equal(out["state"], reference, atol=1e-6)
        assert out["no_grad"] == [["unused.bias", "unused.weight"]] * cfg["steps"]
