"""Workers for tests/lib/parallel/test_zero_trace.py: ``FullyShardedModule.trace`` on 2 ranks."""

from __future__ import annotations

import torch
from torch import nn

from minidist.clock import TimedLayer
from minidist.parallel import zero


def traced_step(comm, units: int, prefetch: bool) -> list:
    """One forward and backward of ``units`` instant TimedLayers under stage 3; the trace."""
    model = nn.Sequential(*(TimedLayer(10, 0.0, 0.0) for _ in range(units)))
    sharded = zero.FullyShardedModule(model, comm, prefetch=prefetch)
    sharded.trace = []
    sharded(torch.zeros(2, 3)).sum().backward()
    return sharded.trace
