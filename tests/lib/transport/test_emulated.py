"""EmulatedLinkComm: messages cost at least alpha + n / bandwidth; results unchanged."""

from __future__ import annotations

import pytest
import torch

import minidist as md
import trace_workers
from minidist.collectives import cost_model
from minidist.transport.emulated import ETHERNET_10G, EmulatedLinkComm, Link


def test_link_cost_and_serialisation_follow_the_alpha_beta_model():
    link = Link(alpha_s=1e-3, bandwidth_Bps=1e6)
    assert link.cost(2000) == pytest.approx(1e-3 + 2e-3)
    first = link.reserve(2000)
    second = link.reserve(0)  # waits for the first: one port per rank
    assert second - first == pytest.approx(1e-3)
    assert ETHERNET_10G.bandwidth_Bps == 1.25e9 and 10e-6 <= ETHERNET_10G.alpha_s <= 20e-6


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        EmulatedLinkComm(object(), alpha_s=1e-5, bandwidth_Bps=0)
    with pytest.raises(ValueError, match="alpha_s"):
        EmulatedLinkComm(object(), alpha_s=-1, bandwidth_Bps=1e9)
    with pytest.raises(TypeError, match="wraps a communicator"):
        EmulatedLinkComm(object(), alpha_s=1e-5, bandwidth_Bps=1e9)


@pytest.mark.parametrize("transport", ["pipe", "shm"])
def test_a_send_takes_at_least_alpha_plus_n_over_bandwidth(transport):
    alpha, bandwidth, nbytes = 2e-3, 1e8, 1_000_000  # 2 ms + 10 ms per message
    outs = md.launch(
        trace_workers.timed_sends, 2, args=(alpha, bandwidth, nbytes), transport=transport, timeout=60
    )
    one = alpha + nbytes / bandwidth
    print(f"\n{transport}: send {outs[0]['send'] / one:.3f}x, isend {outs[0]['isend'] / one:.3f}x, "
          f"two isends {outs[0]['two_isends'] / (2 * one):.3f}x the model")  # fmt: skip
    assert outs[0]["send"] >= one
    assert outs[0]["isend"] >= one
    assert outs[0]["two_isends"] >= 2 * one  # they share rank 0's link
    assert outs[1]["received_intact"]


@pytest.mark.parametrize("transport", ["pipe", "shm", "torch"])
def test_collectives_over_the_link_equal_the_plain_ones(transport):
    outs = md.launch(
        trace_workers.emulated_collectives, 3, args=tuple(ETHERNET_10G), transport=transport, timeout=120
    )
    for rank, out in enumerate(outs):
        for got, got_async, want in zip(out["emulated"], out["emulated_async"], out["plain"], strict=True):
            assert torch.equal(got, want) and torch.equal(got_async, want)
        facts = out["facts"]
        assert facts["workspace"] is None and facts["auto"] != "shm"  # no shared memory on a network
        assert facts["rank"] == rank and facts["world_size"] == 3
        assert facts["traffic_counted"]


@pytest.mark.parametrize("async_op", [False, True])
def test_ring_allreduce_takes_at_least_the_cost_models_time(async_op):
    p, numel = 3, 300_000  # 1.2 MB of float32
    alpha, bandwidth = 1e-3, 2e8
    outs = md.launch(
        trace_workers.timed_ring_allreduce,
        p,
        args=(alpha, bandwidth, numel, async_op),
        transport="shm",
        timeout=120,
    )
    model = cost_model.AlphaBeta(alpha=alpha, beta=1 / bandwidth, gamma=0.0)
    predicted = cost_model.predict("ring", p, numel * 4, model)
    for rank, (seconds, correct) in enumerate(outs):
        assert correct
        # the rank's own 2 (p-1) messages leave one by one over its link: a hard lower bound
        own_link = 2 * (p - 1) * alpha + cost_model.bytes_sent("ring", p, rank, numel, 4) / bandwidth
        print(f"\nrank {rank}: {seconds * 1e3:.1f} ms, {seconds / predicted:.2f}x the ring prediction")
        assert seconds >= own_link
