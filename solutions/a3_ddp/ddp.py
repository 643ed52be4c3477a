"""Assignment 3: data parallelism with gradient buckets that overlap backward.

Every rank holds the whole model and trains on its own part of the batch. After backward,
every gradient must be the average over the ranks -- then every rank takes the same optimizer
step and the replicas stay equal, as if one process had trained on the whole batch. You write
the function ``assign_buckets`` and four methods of ``BucketedDDP``:

=====  ================================  ==================================================
task   where                             what it does
=====  ================================  ==================================================
1      ``assign_buckets`` (a function)   group the parameters into buckets of at most
                                         ``bucket_mb`` MiB, in the order backward makes
                                         their gradients (reverse registration order)
2      ``BucketedDDP._on_gradient_ready``  a parameter's gradient is ready: copy it into its
       and ``BucketedDDP._launch``       bucket's flat buffer; the bucket's last one
                                         launches the bucket's asynchronous allreduce
                                         (``_launch``: the span, then the allreduce)
3      ``BucketedDDP._finish_backward``  when backward ends: wait for every bucket, divide
                                         by the number of ranks, write the gradients back
4      ``BucketedDDP.no_sync``           a context in which backward only accumulates
=====  ================================  ==================================================

Why buckets, and why overlap. One allreduce per parameter pays the latency of a collective
hundreds of times; one allreduce of everything after backward leaves the network idle while
backward computes and the processor idle while the network works. Buckets of about a MiB,
launched the moment their last gradient is ready, do both: few collectives, and the
communication of the late layers' gradients runs while backward computes the early layers'::

    backward   | grads of layer 4,3 | grads of layer 2,1 | grads of layer 0 |
    comm thread|                    |[allreduce bucket 0]|[allreduce bucket 1]|[bucket 2]|
                                                                  wait, / p, write back ^

The library's asynchronous allreduce does the communication:
``work = md.allreduce(comm, flat, op="sum", async_op=True)`` returns at once; the allreduce
runs on the communicator's communication thread, and ``work.wait()`` returns when ``flat``
holds the sum over the ranks. Every rank must launch its buckets in the same order (they do:
every rank runs the same backward).
Communicate with ``md.allreduce`` only: the grader counts its calls (one per bucket per
step) and notes when each one starts, so the library's own DDP and bucket helpers
(``minidist.parallel``) and ``torch.distributed`` are refused.

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
    """Group parameters into buckets, in the order backward produces their gradients.

    ``named_parameters`` is in registration order (``list(module.named_parameters())``; it
    may name one parameter object twice -- tied weights -- as
    ``module.named_parameters(remove_duplicate=False)`` does). Returns lists of names:

    * only parameters with ``requires_grad`` (frozen ones are never communicated);
    * every parameter object once, under the first name it is listed with;
    * in **reverse** order: backward reaches the last layers first;
    * greedy: walk that order, and close the current bucket when adding the next parameter
      would take it over ``bucket_mb * MIB`` bytes (``numel * element_size``). A parameter
      bigger than that on its own gets a bucket of its own. No empty buckets.

    Example, bucket_mb for 1000 bytes, parameters a, b, c, d of 400, 400, 300, 1200 bytes:
    reversed d, c, b, a -> [[d], [c, b], [a]] (d alone is over; c + b = 700; + a = 1100 is over).
    """
    # TODO(task 1): drop frozen parameters and repeated objects (compare them with `is`, or
    # by id()), reverse, then fill buckets greedily.
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
    size = 0
    for name, param in reversed(order):
        nbytes = param.numel() * param.element_size()
        if current and size + nbytes > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
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
    (``cat="comm"``, ``bytes=`` the bucket's bytes), begun when it is launched and ended when
    its ``wait()`` returns.

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
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        self.module = module
        self.comm = comm
        self.find_unused_parameters = find_unused_parameters
        self.recorder = recorder
        self._synchronizing = True  # False inside no_sync(): backward only accumulates
        self._finish_queued = False  # the end-of-backward callback is queued for this backward
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

    # --- task 2 ------------------------------------------------------------------------------
    def _on_gradient_ready(self, param: nn.Parameter) -> None:
        """Autograd calls this once per backward per parameter, when ``param.grad`` is final.

        ``param.grad`` then holds everything accumulated since the last ``zero_grad`` (inside
        ``no_sync``, several backward passes' worth). Copy it into the bucket's slot, and when
        it was the bucket's last awaited gradient, launch the bucket's allreduce
        (``md.allreduce(self.comm, bucket.flat, op="sum", async_op=True)``; keep the handle in
        ``bucket.work``) and, with a recorder, begin its span. The first call of a backward
        also arranges for ``_finish_backward`` to run when backward ends.
        """
        # TODO(task 2): return at once inside no_sync (self._synchronizing is False); queue
        # self._finish_backward with call_when_backward_ends once per backward
        # (self._finish_queued); copy the gradient into bucket.slot(position); when
        # bucket.waiting is empty, launch (self._launch, below, is yours to write too).
        ### BEGIN SOLUTION TODO(task 2): write _on_gradient_ready
        if not self._synchronizing:
            return
        if not self._finish_queued:
            self._finish_queued = True
            call_when_backward_ends(self._finish_backward)
        bucket, position = self._where[id(param)]
        bucket.slot(position).copy_(param.grad)
        bucket.waiting.discard(position)
        if not bucket.waiting:
            self._launch(bucket)
        ### END SOLUTION

    def _launch(self, bucket: Bucket) -> None:
        """Begin the bucket's span (with a recorder) and start its asynchronous allreduce."""
        # TODO(task 2): self.recorder.begin(f"allreduce bucket {bucket.index}", cat="comm",
        # bytes=bucket.nbytes) returns the token to end later; then the async allreduce.
        ### BEGIN SOLUTION TODO(task 2): write _launch
        if self.recorder is not None:
            bucket.span = self.recorder.begin(
                f"allreduce bucket {bucket.index}", cat="comm", bytes=bucket.nbytes
            )
        bucket.work = md.allreduce(self.comm, bucket.flat, op="sum", async_op=True)
        ### END SOLUTION

    # --- task 3 ------------------------------------------------------------------------------
    def _finish_backward(self) -> None:
        """When backward ends: every gradient averaged over the ranks, written back to ``.grad``.

        1. Buckets not launched yet have parameters that got no gradient in this backward.
           With ``find_unused_parameters`` zero their slots and launch them, in bucket order;
           without it, raise a ``RuntimeError`` naming those parameters and saying to pass
           ``find_unused_parameters=True``.
        2. For every bucket in order: ``wait()``, divide ``flat`` by the number of ranks, end
           the span, and copy each parameter's slot into its ``.grad`` -- except parameters
           whose ``.grad`` is None (unused: they stay None).
        3. Reset every bucket for the next backward, and ``self._finish_queued``.
        """
        # TODO(task 3): steps 1-3 above. A parameter still in bucket.waiting got no gradient.
        ### BEGIN SOLUTION TODO(task 3): write _finish_backward
        self._finish_queued = False
        missing = [b for b in self._buckets if b.work is None]
        if missing and not self.find_unused_parameters:
            names = [b.names[i] for b in missing for i in sorted(b.waiting)]
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                bucket.reset()
            raise RuntimeError(
                f"parameters {names} received no gradient in this backward, so their buckets were "
                "never complete; pass find_unused_parameters=True if the model does not use every "
                "parameter in every forward pass"
            )
        for bucket in missing:
            for position in bucket.waiting:
                bucket.slot(position).zero_()
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.work.wait()
            bucket.flat.div_(self.comm.world_size)
            if self.recorder is not None:
                self.recorder.end(bucket.span)
            for position, param in enumerate(bucket.params):
                if param.grad is not None:
                    param.grad.copy_(bucket.slot(position))
            bucket.reset()
        ### END SOLUTION

    # --- task 4 ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside ``with ddp.no_sync():`` backward only accumulates local gradients.

        Gradient accumulation: run ``k - 1`` micro-batches inside ``no_sync``, the last one
        outside; its backward communicates the sum of all ``k`` (``.grad`` accumulates), so a
        step costs one allreduce per bucket instead of ``k``. Leaving the context (also by an
        exception) turns synchronisation back on.
        """
        # TODO(task 4): switch self._synchronizing off for the body of the with-statement.
        ### BEGIN SOLUTION TODO(task 4): write no_sync
        previous = self._synchronizing
        self._synchronizing = False
        try:
            yield
        finally:
            self._synchronizing = previous
        ### END SOLUTION
