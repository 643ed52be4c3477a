"""Workers for lecture 05, sections 3, 4 and 8: ways to average BERT's gradients, timed and traced."""

import functools
import time

import torch

import minidist as md
from minidist import trace
from minidist.models import bert
from minidist.parallel.buckets import allreduce_average
from minidist.parallel.ddp import DistributedDataParallel
from minidist.transport.emulated import EmulatedLinkComm

RING = functools.partial(allreduce_average, algorithm="ring")  # every bucket by the ring algorithm


def my_share(comm, batch):
    """Rank r's rows r*b .. (r+1)*b - 1 of every tensor in `batch` (b = rows / world size)."""
    b = batch[0].shape[0] // comm.world_size
    return [t[comm.rank * b : (comm.rank + 1) * b] for t in batch]


def build(comm, config_name, recorder, bucket_mb=None, overlap=True, link=None, hook=RING):
    """BERT from seed 0; with bucket_mb, wrapped in our DDP over `comm` or an emulated `link`
    (a LinkSpec: alpha_s, bandwidth_Bps)."""
    torch.manual_seed(0)
    model = bert.BertForMLM(bert.CONFIGS[config_name])
    if bucket_mb is None:
        return model  # no DDP: this rank computes alone
    wire = EmulatedLinkComm(comm, *link) if link else comm
    return DistributedDataParallel(
        model, wire, bucket_mb=bucket_mb, overlap=overlap, comm_hook=hook, recorder=recorder
    )


def time_variants(comm, config_name, batch, variants, rounds):
    """Time forward + backward steps of BERT for each variant {name: options of `build`}.

    The variants take turns, one step each per round (a machine that gets busier slows them
    all alike); round 0 warms up. Returns, per variant: the number of buckets, the messages
    and bytes this rank sent in a step, the fastest step's seconds (a busy moment of the
    machine spoils one step, not the measurement), and of the last round the trace events
    and the (averaged) gradient as one flat vector.
    """
    input_ids, labels = my_share(comm, batch)
    recorders = {name: trace.Recorder(rank=comm.rank) for name in variants}
    models = {name: build(comm, config_name, recorders[name], **opts) for name, opts in variants.items()}
    seconds, sent, grads = {name: [] for name in models}, {}, {}
    for _ in range(rounds + 1):
        for name, model in models.items():
            md.barrier(comm)  # start together
            sent_before, start_ns = comm.stats.copy(), time.perf_counter_ns()
            model(input_ids, labels=labels).loss.backward()
            seconds[name].append((time.perf_counter_ns() - start_ns) / 1e9)
            sent[name] = comm.stats - sent_before
            grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
            model.zero_grad(set_to_none=False)
            events = recorders[name].events
            events[:] = [e for e in events if e["ts_us"] * 1000 >= start_ns]  # keep the last step's
    return {
        name: dict(
            buckets=len(model.buckets) if isinstance(model, DistributedDataParallel) else 0,
            messages=sent[name].messages_sent,
            bytes=sent[name].bytes_sent,
            seconds=min(seconds[name][1:]),
            events=recorders[name].events,
            grad=grads[name],
        )
        for name, model in models.items()
    }
