"""Gradient buckets for data parallelism: who goes in which bucket, and how a bucket travels.

A bucket is one flat gradient buffer shared by a few parameters, so that many
small gradients cross the network as one message-sized piece instead of one
collective each (every collective pays the latency alpha at least once)::

    parameters, in registration order:   embed  block1.w  block1.b  block2.w  block2.b  head.w
    gradients become ready (backward):   head.w  block2.b  block2.w  block1.b  block1.w  embed
    buckets (cap 1 MB), reverse order:   [head.w block2.b] [block2.w block1.b] [block1.w] [embed]
                                          bucket 0           bucket 1            bucket 2   bucket 3

Backward computes the last layer's gradients first, so filling buckets in
*reverse* registration order makes bucket 0 the first one complete: its
allreduce can start while backward still works on the earlier layers.

Each parameter owns a slice of its bucket's ``buffer`` (``views[i]`` is that
slice shaped like the parameter). After the first step ``param.grad`` *is* that
view, so the next backward accumulates straight into the bucket (no copy) as long
as gradients are zeroed in place (``zero_grad(set_to_none=False)``); after
``set_to_none=True`` autograd makes a fresh tensor and the DDP hook copies it in
once and points ``param.grad`` back at the view.

The default communication of a bucket is ``allreduce_average``: an allreduce with
``op="avg"`` on the communicator's communication thread (the division by the
world size happens there too, not on the training thread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..collectives import allreduce, broadcast
from ..collectives.async_ops import stream_of
from ..comm import Communicator, DerivedWork, Handle

MB = 1 << 20


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the parameters that live in it.

    ``pending`` counts parameters whose gradient this backward has not yet
    delivered; when it reaches zero the bucket may be launched. ``work`` is the
    handle of its allreduce in flight; ``span`` its recorder token; ``ready`` and
    ``used`` say, per parameter, whether it was marked ready and whether it had a
    gradient on this rank (``find_unused_parameters`` allreduces the latter).
    """

    index: int
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    pending: int = 0
    launched: bool = False
    work: object = None
    span: object = None
    ready: list[bool] = field(default_factory=list)
    used: list[bool] = field(default_factory=list)  # had a gradient on this rank this step

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.ready = [False] * len(self.params)
        self.used = [False] * len(self.params)
        self.launched, self.work, self.span = False, None, None


def assign_buckets(named_params: list[tuple[str, nn.Parameter]], cap_bytes: float) -> list[list[int]]:
    """Indices into ``named_params`` per bucket, filled in reverse order.

    A bucket is closed once it holds at least ``cap_bytes`` (so ``cap_bytes=0``
    gives one parameter per bucket and ``math.inf`` one bucket for everything),
    or when the next parameter has another dtype or device (a flat buffer has one).
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(named_params))):
        param = named_params[index][1]
        if current:
            first = named_params[current[0]][1]
            if (param.dtype, param.device) != (first.dtype, first.device):
                groups.append(current)
                current, size = [], 0
        current.append(index)
        size += param.numel() * param.element_size()
        if size >= cap_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def make_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_mb: float) -> list[Bucket]:
    """Build the buckets (buffers and views) for parameters that require gradients."""
    if not (bucket_mb >= 0):  # also catches nan
        raise ValueError(f"bucket_mb must be >= 0 (math.inf: one bucket), got {bucket_mb}")
    cap = math.inf if math.isinf(bucket_mb) else bucket_mb * MB
    buckets = []
    for index, group in enumerate(assign_buckets(named_params, cap)):
        params = [named_params[i][1] for i in group]
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket = Bucket(index, [named_params[i][0] for i in group], params, buffer, views)
        bucket.reset()
        buckets.append(bucket)
    return buckets


def broadcast_module_state(comm: Communicator, module: nn.Module, src: int = 0) -> int:
    """Make every rank's parameters and buffers equal to rank ``src``'s, in ONE broadcast.

    All tensors are packed, as raw bytes, into one flat uint8 buffer (any mix of
    dtypes fits), broadcast once, and unpacked. Returns the number of bytes.
    A model of another size on some rank shows up as a clear MessageMismatch.
    """
    tensors = [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
    tensors = [t for t in tensors if t.numel() > 0]
    if comm.world_size == 1 or not tensors:
        return 0
    device = tensors[0].device
    flats = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in tensors]
    packed = torch.cat([f.to(device) for f in flats])
    broadcast(comm, packed, src=src)
    if comm.rank != src:
        offset = 0
        with torch.no_grad():
            for t, f in zip(tensors, flats):
                piece = packed[offset : offset + f.numel()]
                t.copy_(piece.to(t.device).view(t.dtype).view_as(t))
                offset += f.numel()
    return packed.numel()


class AveragedWork(DerivedWork):
    """Handle of ``allreduce_average`` on the CPU: ``wait()`` returns the averaged buffer.

    The division by p is part of the collective (``op="avg"``): it runs on the
    communication thread while backward goes on, each rank dividing only the slice
    it reduces -- not on the training thread after backward, where a pass over all
    gradients (20 MiB for BERT mini: a few ms) would add to every step.
    """

    def __init__(self, work: Handle, flat: torch.Tensor) -> None:
        super().__init__(work)
        self.flat = flat

    def finish(self, _result: torch.Tensor | None) -> torch.Tensor:
        return self.flat


class CudaAveragedWork(DerivedWork):
    """Handle of ``allreduce_average`` on a GPU: ``wait()`` makes the caller's stream
    wait for the communication stream (no host synchronisation of the kernels)."""

    def __init__(self, work: Handle, done: torch.cuda.Event, flat: torch.Tensor) -> None:
        super().__init__(work)
        self.done, self.flat = done, flat

    def finish(self, _result: torch.Tensor | None) -> torch.Tensor:
        torch.cuda.current_stream(self.flat.device).wait_event(self.done)
        return self.flat


_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def allreduce_average(
    comm: Communicator, flat_grad: torch.Tensor, bucket_index: int, algorithm: str = "auto"
):
    """The default DDP comm hook: the average of every rank's ``flat_grad``, in place.

    Starts ``allreduce(op="avg", async_op=True)`` (a sum whose division by the
    world size is done inside the collective, on the communication thread) and
    returns a handle whose ``wait()`` returns ``flat_grad``. Cost: one allreduce
    of the bucket (ring: 2(p-1)/p * bucket bytes sent per rank).
    Use ``functools.partial(allreduce_average, algorithm="ring")`` to pick the algorithm.

    On a GPU the allreduce runs on a separate CUDA stream: an event recorded on
    the caller's stream (where backward wrote the gradients) is waited for by the
    communication stream before anything is sent, and ``wait()`` makes the
    caller's stream wait for the communication stream -- compute and
    communication overlap on the device, and neither reads half-written data.
    """
    if not flat_grad.is_cuda:
        work = allreduce(comm, flat_grad, op="avg", algorithm=algorithm, async_op=True)
        return AveragedWork(work, flat_grad)
    device = flat_grad.device
    comm_stream = _COMM_STREAMS.get(device)
    if comm_stream is None:  # one communication stream per GPU, made once
        comm_stream = _COMM_STREAMS[device] = torch.cuda.Stream(device)
    grads_written = torch.cuda.Event()
    grads_written.record(torch.cuda.current_stream(device))
    done = torch.cuda.Event()

    def on_comm_thread() -> torch.Tensor:
        with torch.cuda.device(device), torch.cuda.stream(comm_stream):
            comm_stream.wait_event(grads_written)
            allreduce(comm, flat_grad, op="sum", algorithm=algorithm)  # inline: we are the comm thread
            flat_grad.div_(comm.world_size)
            done.record(comm_stream)
        return flat_grad

    work = stream_of(comm).submit(f"DDP bucket {bucket_index} allreduce (cuda)", on_comm_thread)
    return CudaAveragedWork(work, done, flat_grad)
