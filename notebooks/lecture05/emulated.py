"""Workers for lecture 05, sections 3, 4 and 8: DDP steps of BERT-mini on the emulated clock."""

import math
import time

import torch
from torch import nn

import minidist as md
from minidist import trace
from minidist.clock import GPUSpec, TimedLayer
from minidist.models import bert
from minidist.parallel.buckets import allreduce_average
from minidist.parallel.ddp import DistributedDataParallel
from minidist.transport.emulated import EmulatedLinkComm, LinkSpec


def timed_bert(config_name, gpu, tokens):
    """BERT's parameter tensors, in BERT's order, as TimedLayers: a matrix of N entries takes
    a dense layer's time on `gpu` for `tokens` tokens (2NT FLOPs forward, 4NT backward);
    a vector (a bias, a LayerNorm's scale or shift) takes none."""
    with torch.device("meta"):  # shapes only
        shapes = [p.shape for p in bert.BertForMLM(bert.CONFIGS[config_name]).parameters()]
    layers = []
    for shape in shapes:
        numel = math.prod(shape)
        forward_flops = 2 * numel * tokens if len(shape) == 2 else 0
        layers.append(TimedLayer(numel, gpu.seconds(forward_flops), gpu.seconds(2 * forward_flops)))
    return nn.Sequential(*layers)


def slow_motion(gpu, link, factor):
    """The same GPU and link, `factor` times slower: every emulated time is `factor` times longer."""
    slow_gpu = GPUSpec(f"{gpu.name}, {factor}x slower", gpu.peak_flops / factor, gpu.utilization)
    return slow_gpu, LinkSpec(link.alpha_s * factor, link.bandwidth_Bps / factor)


def on_link(wire, hook):
    """A DDP comm hook that runs `hook` (a ring allreduce) over `wire`, the emulated link."""
    return lambda _comm, flat_grad, bucket_index: hook(wire, flat_grad, bucket_index, algorithm="ring")


def time_steps(comm, gpu, tokens, link, variants, steps, traced=()):
    """Time `steps` steps (after one warm-up) of timed BERT-mini for each variant
    {name: DDP options (bucket_mb, overlap, hook), or None: no DDP, no communication}.

    Returns per variant: the seconds of each step (forward, then backward, which ends when the
    last bucket's allreduce has), the messages and bytes this rank sent in a step, the number of
    buckets, and for the names in `traced` the trace of the last step."""
    wire = EmulatedLinkComm(comm, *link)  # every message: alpha + bytes / bandwidth
    results = {}
    for name, options in variants.items():
        model = timed_bert("mini", gpu, tokens)
        recorder = trace.Recorder(rank=comm.rank) if name in traced else None
        ddp = model
        if options is not None:
            options = dict(options)
            hook = on_link(wire, options.pop("hook", allreduce_average))
            ddp = DistributedDataParallel(model, comm, comm_hook=hook, recorder=recorder, **options)
        x = torch.zeros(1)  # TimedLayers pass the input through; their weights make the graph
        seconds = []
        for _ in range(steps + 1):
            md.barrier(comm)  # the ranks start each step together
            if recorder is not None:
                recorder.events.clear()
            before, start = comm.stats.copy(), time.perf_counter()
            ddp(x).sum().backward()  # DDP's hooks launch each bucket's allreduce as it fills
            seconds.append(time.perf_counter() - start)
            sent = comm.stats - before
            model.zero_grad(set_to_none=False)
        results[name] = dict(
            seconds=seconds[1:],  # step 0 warmed up
            messages=sent.messages_sent,
            bytes=sent.bytes_sent,
            buckets=len(ddp.buckets) if options is not None else 0,
            events=list(recorder.events) if recorder is not None else [],
        )
    wire.close()
    return results
