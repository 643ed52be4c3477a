"""The emulated clock: layers take the time their FLOPs would on the stated GPU, with real gradients."""

import time

import pytest
import torch

from minidist.clock import GPUSpec, TimedLayer, timed_mlp, wait


def test_gpu_seconds_is_flops_over_the_sustained_rate():
    gpu = GPUSpec("test", peak_flops=100e12, utilization=0.5)
    assert gpu.flops_per_s == 50e12
    assert gpu.seconds(6 * 1e9 * 1000) == pytest.approx(0.12)  # 6 N T for 1B parameters, 1000 tokens


def test_timed_mlp_layers_follow_the_six_n_t_rule():
    gpu = GPUSpec("test", 1e12, 1.0)
    model = timed_mlp([1000, 3000], gpu, tokens=500)
    assert [layer.weight.numel() for layer in model] == [1000, 3000]
    assert [layer.t_forward for layer in model] == pytest.approx(
        [2 * 1000 * 500 / 1e12, 2 * 3000 * 500 / 1e12]
    )
    assert [layer.t_backward for layer in model] == pytest.approx(
        [4 * 1000 * 500 / 1e12, 4 * 3000 * 500 / 1e12]
    )


def test_forward_and_backward_take_at_least_their_time_and_make_every_gradient():
    """Waits never end early (they may end late on a busy machine: no upper bound is asserted)."""
    model = torch.nn.Sequential(TimedLayer(10, 0.02, 0.03), TimedLayer(5, 0.01, 0.02))
    x = torch.ones(3, requires_grad=True)
    start = time.perf_counter()
    y = model(x)
    forward = time.perf_counter() - start
    assert torch.equal(y, x)
    start = time.perf_counter()
    y.sum().backward()
    backward = time.perf_counter() - start
    assert forward >= 0.03 and backward >= 0.05
    assert torch.equal(x.grad, torch.ones(3))
    assert all(torch.equal(layer.weight.grad, torch.ones_like(layer.weight)) for layer in model)


def test_wait_of_zero_or_less_neither_sleeps_nor_spins(monkeypatch):
    calls = []
    monkeypatch.setattr(time, "sleep", calls.append)
    monkeypatch.setattr(time, "perf_counter", lambda: calls.append("clock") or 0.0)
    wait(0)
    wait(-1)
    assert calls == []


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="numel >= 1"):
        TimedLayer(0, 0.1, 0.1)
