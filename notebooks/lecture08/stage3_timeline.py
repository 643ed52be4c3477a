"""Lecture 08, section 2.1: stage 3 on the emulated clock -- when each unit is gathered, used and freed."""

import time

import torch
from torch import nn

from minidist.clock import TimedLayer
from minidist.parallel import zero
from minidist.transport.emulated import EmulatedLinkComm


def gather_timeline(comm, units, numel, t_forward, t_backward, alpha_s, bandwidth_Bps, steps=3):
    """Rank body: stage 3 over ``units`` timed layers of ``numel`` parameters each, on an emulated link,
    without and with prefetch. Per setting: the forward and backward seconds of every step, the
    last step's events (seconds from its start), the most units gathered at once, the unit names."""
    link = EmulatedLinkComm(comm, alpha_s, bandwidth_Bps)
    out = {}
    for prefetch in (False, True):
        model = nn.Sequential(*(TimedLayer(numel, t_forward, t_backward) for _ in range(units)))
        sharded = zero.FullyShardedModule(model, link, prefetch=prefetch)
        x = torch.zeros(8, 16)
        forward_s, backward_s = [], []
        for _ in range(steps):
            link.barrier()  # both ranks start the step together
            sharded.trace = []  # every unit's events in this step
            start = time.perf_counter()
            y = sharded(x)
            middle = time.perf_counter()
            y.sum().backward()
            forward_s.append(middle - start)
            backward_s.append(time.perf_counter() - middle)
            for shard in sharded.parameters():
                shard.grad = None
        out[prefetch] = {
            "forward_s": forward_s,
            "backward_s": backward_s,
            "events": [(t - start, unit, what, held) for t, unit, what, held in sharded.trace],
            "peak_gathered_units": sharded.peak_gathered_units,
            "units": [u.name for u in sharded.all_units],
        }
    link.close()
    return out
