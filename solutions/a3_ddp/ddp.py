"""Assignment 3: data parallelism with gradient buckets that overlap backward.

Every rank holds the whole model and trains on its own part of the batch. After backward,
every gradient must be the average over the ranks -- then every rank takes the same optimizer
step and the replicas stay equal, as if one process had trained on the whole batch. Lecture 5
(sections 3 to 5) builds this design; Li et al. (2020), "PyTorch Distributed: experiences on
accelerating data parallel training", sections 3 and 4, is the paper behind it. You write:

=====  ====================================  ==============================================
task   where                                 what it is for
=====  ====================================  ==============================================
1      ``assign_buckets``                    which parameters share one allreduce
2      ``_on_gradient_ready``, ``_launch``,  the gradient hook: buckets leave, in bucket
       ``no_sync``                           order, while backward still computes
3      ``_finish_backward``                  the end of backward: averaged gradients in
                                             ``.grad``, unused parameters handled
4      ``tuned_bucket_mb``                   a bucket cap for a given model and link,
                                             graded on its emulated step time (in tiers)
=====  ====================================  ==============================================

**The two rules**, the same as lecture 5's and the library's (``minidist.parallel``):

* *Buckets.* Take the trainable parameters in reverse registration order (roughly the order in
  which backward produces their gradients); each joins the open bucket, and a bucket is closed
  as soon as it holds **at least** the cap, or before a parameter of another dtype (a flat
  buffer has one). The rest at the end is the last bucket. This is PyTorch's rule (Li et al.,
  section 3.2.2; ``compute_bucket_assignment_by_size`` in its code): every bucket but the last
  carries at least the cap, so a step makes at most ``bytes / cap + 1`` allreduces and pays the
  latency that often; a tensor larger than the cap needs no special case; ``cap = 0`` gives one
  bucket per parameter, an infinite cap one bucket.
* *Launch order.* Buckets are launched **strictly in bucket order**: bucket k only after buckets
  0..k-1, each as soon as it and all before it are complete. A bucket that completes early waits
  for the ones before it (Li et al., section 3.2.3). Every rank must issue its collectives in
  the same order (lecture 2), and autograd's order of gradients may differ between ranks;
  bucket order never does.

The library's asynchronous allreduce does the communication:
``work = md.allreduce(comm, flat, op="sum", async_op=True)`` returns a handle at once; the
allreduce runs on the communicator's communication thread, ``work.wait()`` returns when
``flat`` holds the sum over the ranks, and ``work.add_done_callback(fn)`` calls ``fn(work)``
when it completes (in the thread that completed it). Communicate with ``md.allreduce`` only:
the grader logs its calls (one per bucket per step, each carrying its bucket's gradient) and
when each one starts, so the library's own DDP and bucket helpers (``minidist.parallel``) and
``torch.distributed`` are refused.

**Unused parameters.** A parameter that takes no part in the forward pass gets no gradient,
so its hook never runs and its bucket would never be complete. With
``find_unused_parameters=True`` the end of backward launches the buckets still waiting, the
missing gradients counted as zeros, and those parameters keep ``grad = None`` (as in one
process: the optimizer skips them). Without it, that is an error that says to pass it. Here
"unused" means unused on every rank (a branch the model never calls), as in the tests.

Run the public tests from this folder (``grep -n "TODO(task" ddp.py``: what is left)::

    python -m pytest -q test_a3_ddp.py
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

import minidist as md

__all__ = [
    "MIB",
    "Bucket",
    "BucketedDDP",
    "assign_buckets",
    "broadcast_parameters",
    "call_when_backward_ends",
    "tuned_bucket_mb",
]

MIB = 1 << 20  # bytes in a MiB: bucket_mb=1.0 means buckets of at most 1,048,576 bytes


# --- given helpers: use them, you do not need to change them ----------------------------
def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """Run ``callback()`` once the backward pass now running has computed every gradient.

    Call it from inside backward (from a gradient hook): autograd runs the callback after its
    last node, before ``loss.backward()`` returns, in the thread that ran backward. An
    exception the callback raises comes out of ``loss.backward()``.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def broadcast_parameters(module: nn.Module, comm) -> None:
    """Copy rank 0's parameters and buffers into every rank's module (DDP's first step).

    Replicas that start apart stay apart: averaged gradients keep equal replicas equal, they
    do not make different ones equal.
    """
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            md.broadcast(comm, tensor.data, src=0)


@dataclass
class Bucket:
    """One bucket: its parameters, where each one's gradient sits in ``flat``, and its state.

    ``flat`` is one contiguous buffer of the parameters' dtype, ``sum(p.numel())`` elements;
    parameter ``params[i]`` owns ``flat[offsets[i] : offsets[i] + params[i].numel()]``.
    ``waiting`` holds the positions (in ``params``) whose gradient this backward has not
    delivered yet; ``work`` is the allreduce in flight (None: not launched in this backward);
    ``span`` is the trace token of that allreduce (None without a recorder).
    """

    index: int
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    waiting: set[int] = field(default_factory=set)
    work: object | None = None
    span: object | None = None

    @classmethod
    def of(cls, index: int, names: list[str], params: list[nn.Parameter]) -> Bucket:
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        dtype = params[0].dtype if params else torch.float32
        bucket = cls(index, names, params, offsets, torch.zeros(total, dtype=dtype))
        bucket.reset()
        return bucket

    def reset(self) -> None:
        """Ready for the next backward: every gradient awaited, nothing in flight."""
        self.waiting = set(range(len(self.params)))
        self.work, self.span = None, None

    def slot(self, position: int) -> torch.Tensor:
        """The part of ``flat`` that holds ``params[position]``'s gradient, shaped like it."""
        param = self.params[position]
        start = self.offsets[position]
        return self.flat[start : start + param.numel()].view_as(param)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


# --- task 1 ----------------------------------------------------------------------------------
def assign_buckets(named_parameters: list[tuple[str, nn.Parameter]], bucket_mb: float) -> list[list[str]]:
    """The buckets, bucket 0 first, as lists of parameter names, by the bucket rule above.

    ``named_parameters`` is in registration order (``list(module.named_parameters())``; it
    may name one parameter object twice -- tied weights -- as
    ``module.named_parameters(remove_duplicate=False)`` does). Only parameters with
    ``requires_grad`` are communicated, each parameter object once, under the first name it is
    listed with. The cap is ``bucket_mb * MIB`` bytes (a tensor's bytes: ``numel *
    element_size``). No empty buckets.

    Example, a cap of 1000 bytes, parameters a, b, c, d of 400, 400, 300, 1200 bytes:
    [[d], [c, b, a]] (d alone reaches the cap; c + b = 700 does not, c + b + a = 1100 does).

    Cost: once, when the DDP is built; but it fixes how many allreduces every step makes, each
    paying the latency of a collective, and how early each can start (lecture 5, section 4).
    Read: lecture 5, Try it 2 (the same rule); Li et al. (2020), section 3.2.2.
    """
    # TODO(task 1): How do you tell a tied weight's second name from a new parameter? Which
    # order does backward produce gradients in? When is a bucket closed, and what else closes it?
    ### BEGIN SOLUTION TODO(task 1): write assign_buckets
    limit = bucket_mb * MIB
    seen: set[int] = set()
    order = []
    for name, param in named_parameters:
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            order.append((name, param))
    buckets: list[list[str]] = []
    current: list[str] = []
    size, dtype = 0, None
    for name, param in reversed(order):
        if current and param.dtype != dtype:  # a flat buffer has one dtype
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += param.numel() * param.element_size()
        dtype = param.dtype
        if size >= limit:  # closed once it holds at least the cap
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
    ### END SOLUTION


class BucketedDDP:
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over the ranks.

    ::

        model = BucketedDDP(make_model(), comm, bucket_mb=1.0)
        loss = loss_fn(model(inputs), targets)   # this rank's part of the batch
        loss.backward()                           # gradients are the average over the ranks
        optimizer.step()

    ``comm``: this rank's communicator. ``recorder``: None, or a ``minidist.trace.Recorder``
    (only its ``begin`` and ``end`` are used; the grader's recorder has nothing else); then
    every bucket's allreduce is recorded as a span named ``"allreduce bucket <index>"``
    (``cat="comm"``, ``bytes=`` the bucket's bytes) that begins when the allreduce is launched
    and ends when it **completes** -- not when someone gets round to ``wait()`` for it, so that
    the trace shows how much communication really ran inside backward (``_end_span``, given,
    ends a bucket's span once, whichever thread calls it first).

    Cost per step: one allreduce per bucket (``len(self.buckets)`` of them), the gradients'
    bytes in all; the copies into and out of the flat buffers; nothing inside ``no_sync``.
    """

    def __init__(
        self,
        module: nn.Module,
        comm,
        bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        recorder=None,
    ) -> None:
        if not bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
        self.module = module
        self.comm = comm
        self.find_unused_parameters = find_unused_parameters
        self.recorder = recorder
        self._synchronizing = True  # False inside no_sync(): backward only accumulates
        self._finish_queued = False  # the end-of-backward callback is queued for this backward
        self._next_launch = 0  # the index of the next bucket to launch in this backward
        self._span_lock = threading.Lock()  # _end_span runs on two threads
        broadcast_parameters(module, comm)
        by_name = dict(module.named_parameters())
        #: the buckets as lists of parameter names, in launch order (task 1's answer)
        self.buckets: list[list[str]] = assign_buckets(list(module.named_parameters()), bucket_mb)
        self._buckets = [
            Bucket.of(index, names, [by_name[name] for name in names])
            for index, names in enumerate(self.buckets)
        ]
        #: id(parameter) -> (its bucket, its position in the bucket)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for owner in self._buckets:
            for position, param in enumerate(owner.params):
                self._where[id(param)] = (owner, position)
                param.register_post_accumulate_grad_hook(self._on_gradient_ready)

    def __call__(self, *args, **kwargs):
        """The wrapped module's forward (hooks do the rest during backward)."""
        return self.module(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The wrapped module's parameters (for the optimizer)."""
        return self.module.parameters()

    def _end_span(self, bucket: Bucket) -> None:
        """End the bucket's span (with a recorder), once: the first call ends it, later calls
        do nothing. Safe to call from the communication thread and the training thread."""
        with self._span_lock:
            token, bucket.span = bucket.span, None
        if token is not None and self.recorder is not None:
            self.recorder.end(token)

    # --- task 2 ------------------------------------------------------------------------------
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once per backward per parameter, when ``param.grad`` is final.

        Contract: the gradient lands in its bucket's slot of ``flat`` (``Bucket.slot``); every
        bucket that may leave by the launch-order rule leaves now, from this hook, not later;
        inside ``no_sync`` nothing is copied or sent; the first call of a backward arranges for
        ``_finish_backward`` to run when backward ends (``call_when_backward_ends``, once per
        backward). ``param.grad`` holds everything accumulated since the last ``zero_grad``.

        Cost: one copy of the gradient; no waiting (the hook runs on backward's thread, and
        every moment spent here is a moment backward stands still).
        Read: lecture 5, section 3 ("buckets and hooks") and section 4; Li et al., section 3.2.3.
        """
        # TODO(task 2): Which state tells you a bucket is complete, and which one may leave now
        # if an earlier bucket is still waiting? What must a backward inside no_sync skip?
        ### BEGIN SOLUTION TODO(task 2): write _on_gradient_ready
        if not self._synchronizing:
            return
        if not self._finish_queued:
            self._finish_queued = True
            call_when_backward_ends(self._finish_backward)
        bucket, position = self._where[id(param)]
        bucket.slot(position).copy_(param.grad)
        bucket.waiting.discard(position)
        while self._next_launch < len(self._buckets) and not self._buckets[self._next_launch].waiting:
            self._launch(self._buckets[self._next_launch])
        ### END SOLUTION

    def _launch(self, bucket: Bucket) -> None:
        """Start the bucket's asynchronous sum-allreduce of ``bucket.flat`` (the handle in
        ``bucket.work``) and, with a recorder, its span: from now until the allreduce completes.

        Contract: returns at once; buckets are launched in bucket order only
        (``self._next_launch`` is the next one's index); ``bucket.span`` holds the recorder's
        token. Cost: one ``md.allreduce`` of ``bucket.nbytes``.
        """
        # TODO(task 2): Which handle method tells you when the allreduce has completed, and in
        # which thread does it run what you give it?
        ### BEGIN SOLUTION TODO(task 2): write _launch
        if self.recorder is not None:
            bucket.span = self.recorder.begin(
                f"allreduce bucket {bucket.index}", cat="comm", bytes=bucket.nbytes
            )
        bucket.work = md.allreduce(self.comm, bucket.flat, op="sum", async_op=True)
        self._next_launch = bucket.index + 1
        if bucket.span is not None:  # the span ends when the allreduce completes
            bucket.work.add_done_callback(lambda _work, b=bucket: self._end_span(b))
        ### END SOLUTION

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside ``with ddp.no_sync():`` backward only accumulates local gradients.

        Gradient accumulation: run ``k - 1`` micro-batches inside ``no_sync``, the last one
        outside; its backward communicates the sum of all ``k`` (``.grad`` accumulates), so a
        step costs one allreduce per bucket instead of ``k``. Leaving the context (also by an
        exception) turns synchronisation back on. Read: lecture 5, section 5.
        """
        # TODO(task 2): What does your hook read to know it is inside no_sync, and what if the
        # body raises?
        ### BEGIN SOLUTION TODO(task 2): write no_sync
        previous = self._synchronizing
        self._synchronizing = False
        try:
            yield
        finally:
            self._synchronizing = previous
        ### END SOLUTION

    # --- task 3 ------------------------------------------------------------------------------
    def _finish_backward(self) -> None:
        """When backward ends: every gradient averaged over the ranks, written back to ``.grad``.

        Contract: buckets not launched yet (a parameter in ``bucket.waiting`` got no gradient in
        this backward) are launched in bucket order with zeros for the missing gradients when
        ``find_unused_parameters`` is set; without it, a ``RuntimeError`` names those parameters
        and says to pass ``find_unused_parameters=True`` (and leaves nothing in flight). Then
        every parameter that has a ``.grad`` holds the average over the ranks; unused ones keep
        ``grad = None``; every bucket is ready for the next backward, and so is the DDP.

        Cost: the wait for the allreduces still in flight (the only communication a step cannot
        hide), one division and one copy per bucket.
        Read: lecture 5, sections 3 and 6; Li et al., section 3.2.3 (globally unused parameters).
        """
        # TODO(task 3): Which buckets can still be unlaunched here, and in which order may they
        # go? What state must be reset, also when you raise?
        ### BEGIN SOLUTION TODO(task 3): write _finish_backward
        self._finish_queued = False
        missing = [b for b in self._buckets if b.work is None]
        if missing and not self.find_unused_parameters:
            names = [b.names[i] for b in missing for i in sorted(b.waiting)]
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                bucket.reset()
            self._next_launch = 0
            raise RuntimeError(
                f"parameters {names} received no gradient in this backward, so their buckets were "
                "never complete; pass find_unused_parameters=True if the model does not use every "
                "parameter in every forward pass"
            )
        for bucket in missing:  # in bucket order
            for position in bucket.waiting:
                bucket.slot(position).zero_()
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.work.wait()
            bucket.flat.div_(self.comm.world_size)
            self._end_span(bucket)  # ended by the callback already, unless it runs late
            for position, param in enumerate(bucket.params):
                if param.grad is not None:
                    param.grad.copy_(bucket.slot(position))
            bucket.reset()
        self._next_launch = 0
        ### END SOLUTION


# --- task 4 ----------------------------------------------------------------------------------
def tuned_bucket_mb(
    named_parameters: list[tuple[str, nn.Parameter]],
    forward_s: float,
    backward_s: dict[str, float],
    alpha_s: float,
    bandwidth_Bps: float,
    world_size: int,
) -> float:
    """The bucket cap (``bucket_mb``) for this model on this link: the measured task.

    The grader builds your ``BucketedDDP`` with the cap you return and times a step on the
    emulated clock of lecture 5 (section 3): the forward takes ``forward_s``; backward
    computes the parameters' gradients in reverse registration order, ``backward_s[name]``
    seconds each; one link per rank carries one message at a time, and a ring allreduce of
    ``n`` bytes takes ``2(p-1) alpha + 2(p-1)/p * n / bandwidth`` (lecture 2). Each allreduce
    starts at the moment your code launched it (the grader notes that moment among the
    gradients' arrivals) or when the link is free, whichever is later; wherever your code waits
    for a handle, backward waits as long. The step ends when backward has ended and the last
    allreduce has completed. Graded in tiers: that step time
    over the lower bound ``max(forward + backward, one allreduce of the whole gradient)``:
    1.05x or less earns full points, 1.25x half, 1.5x a quarter. The library's DDP with its
    default cap, 1 MiB, reaches 1.23x on the grader's model.

    Arguments: ``named_parameters`` in registration order (the model's, float32, all
    trainable), ``alpha_s`` and ``bandwidth_Bps`` the link's, ``world_size`` the number of
    ranks. Returns a cap in MiB (``>= 0``, finite). The grader's model is ``a3_trace.timed_model``
    (the notebook, section 6): a 12-block transformer of width 64 on 524,288 tokens per GPU and
    step, 2 ranks, 1 Gbit/s with ``alpha_s = 50e-6``.

    Cost: what you like, within a second (it runs once, before training).
    Read: lecture 5, section 4 ("How big should a bucket be?": the prediction and the sweep).
    """
    # TODO(task 4): What does a cap that is too small cost on this link, and one that is too
    # large? Can you predict a step's time for a given cap before running it, as lecture 5 does?
    ### BEGIN SOLUTION TODO(task 4): write tuned_bucket_mb
    sizes = {name: p.numel() * p.element_size() for name, p in named_parameters}
    total = sum(sizes.values())
    p = world_size

    def ring(nbytes: float) -> float:
        return 2 * (p - 1) * alpha_s + 2 * (p - 1) / p * nbytes / bandwidth_Bps

    def step(cap_mb: float) -> float:
        clock, ready = forward_s, {}
        for name, _ in reversed(named_parameters):
            clock += backward_s[name]
            ready[name] = clock
        link_free = complete = 0.0
        for bucket in assign_buckets(named_parameters, cap_mb):  # launched in bucket order
            complete = max(complete, max(ready[name] for name in bucket))
            link_free = max(complete, link_free) + ring(sum(sizes[name] for name in bucket))
        return max(clock, link_free)

    caps = [0.0, 2.0**-10]  # one bucket per tensor, then powers of two up to one bucket
    while caps[-1] * MIB < total:
        caps.append(2 * caps[-1])
    return min(caps, key=lambda cap: (step(cap), -cap))
    ### END SOLUTION
