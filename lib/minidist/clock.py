"""The emulated clock: compute that takes the time a stated GPU would take.

On 2 shared CPU cores a BERT step takes as long as the operating system lets it, and
communication over shared memory costs almost nothing, so overlap, bucket sizes, prefetching
and pipeline bubbles do not show, or show differently from run to run. The emulated clock
makes a cluster's *timing* reproducible on a laptop: compute is ``wait(seconds)`` -- the time
a stated GPU would spend on the FLOPs -- and messages go over
``transport.emulated.EmulatedLinkComm`` (alpha + bytes / bandwidth). Waiting costs almost no
CPU, so four ranks on two cores keep their schedule, and a measured step matches the
alpha-beta prediction to a few percent. What it does not model: kernels that compete for
the GPU's memory bandwidth, and the network's congestion.

    gpu = GPUSpec("V100", peak_flops=125e12, utilization=0.4)
    seconds = gpu.seconds(6 * n_params * tokens)          # one training step's compute
    model = timed_mlp([4 << 20] * 8, gpu, tokens=4096)     # 8 layers of 4M parameters
    # forward waits 2 N T / rate per layer, backward 4 N T / rate; gradients are real tensors,
    # produced layer by layer in backward, so DDP's hooks and buckets see them as usual

``TimedLayer`` is the layer: a real parameter of ``numel`` elements (what DDP sends) and a
forward and backward that only wait. Its arithmetic is trivial (the output is the input;
the gradient of the weight is filled with one number), so the measured time is the
emulated one plus a small real overhead that the notebooks measure and report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

__all__ = ["GPUSpec", "TimedLayer", "V100_40", "A100_50", "timed_mlp", "wait", "wait_until"]

_SPIN_S = 2e-4  # the last stretch of a wait is spun (sleep alone overshoots by ~60 us)


def wait_until(deadline: float) -> None:
    """Return at ``time.perf_counter() >= deadline``: sleep most of the way, then spin,
    yielding the GIL (``sleep(0)``) so other threads keep running."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return
        time.sleep(remaining - _SPIN_S if remaining > 2 * _SPIN_S else 0)


def wait(seconds: float) -> None:
    """Take ``seconds`` of emulated compute (no CPU to speak of)."""
    if seconds > 0:
        wait_until(time.perf_counter() + seconds)


class GPUSpec(NamedTuple):
    """A GPU as the clock sees it: ``peak_flops`` at a sustained ``utilization`` (MFU)."""

    name: str
    peak_flops: float
    utilization: float = 0.4

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.utilization

    def seconds(self, flops: float) -> float:
        """Emulated seconds for ``flops`` floating-point operations."""
        return flops / self.flops_per_s


#: NVIDIA V100 (125 TFLOP/s fp16 tensor cores) at 40%, and A100 (312 TFLOP/s bf16) at 50%
V100_40 = GPUSpec("V100 at 40% of 125 TFLOP/s", 125e12, 0.40)
A100_50 = GPUSpec("A100 at 50% of 312 TFLOP/s", 312e12, 0.50)


class _Timed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, t_forward: float, t_backward: float):
        ctx.t_backward = t_backward
        ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
        wait(t_forward)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        wait(ctx.t_backward)
        # the weight's gradient is real (DDP sends it) but cheap to make: one number, repeated
        weight_grad = torch.full(ctx.weight_shape, float(grad.mean()), dtype=ctx.weight_dtype)
        return grad, weight_grad, None, None


class TimedLayer(nn.Module):
    """``numel`` parameters whose forward takes ``t_forward`` s and backward ``t_backward`` s."""

    def __init__(self, numel: int, t_forward: float, t_backward: float) -> None:
        super().__init__()
        if numel < 1 or t_forward < 0 or t_backward < 0:
            raise ValueError(f"need numel >= 1 and times >= 0, got {numel}, {t_forward}, {t_backward}")
        self.weight = nn.Parameter(torch.zeros(numel))
        self.t_forward, self.t_backward = float(t_forward), float(t_backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Timed.apply(x, self.weight, self.t_forward, self.t_backward)

    def extra_repr(self) -> str:
        n = self.weight.numel()
        return f"numel={n}, t_forward={self.t_forward:.4g}, t_backward={self.t_backward:.4g}"


def timed_mlp(layer_numels: Sequence[int], gpu: GPUSpec, tokens: int) -> nn.Sequential:
    """Layers of the given sizes, each timed as a dense layer on ``tokens`` tokens:
    forward ``2 N T`` FLOPs, backward ``4 N T`` (Kaplan et al.'s 6 N T per step in all)."""
    return nn.Sequential(
        *(TimedLayer(n, gpu.seconds(2 * n * tokens), gpu.seconds(4 * n * tokens)) for n in layer_numels)
    )
