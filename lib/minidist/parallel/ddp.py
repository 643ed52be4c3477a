"""Distributed data parallel: every rank trains the same model on its own slice of the batch.

The naive version is ``ddp_naive.py`` (one allreduce per parameter after backward, one short file:
read it first); this one adds buckets, overlap with backward, ``no_sync``, comm hooks and
unused-parameter handling, and is tested against it.

    ddp = DistributedDataParallel(model, comm, bucket_mb=1.0)
    loss = ddp(inputs, targets); loss.backward()    # grads = average over all ranks
    optimizer.step(); optimizer.zero_grad()          # identical update on every rank

Why it is exact: with a loss that is a mean over the batch, the gradient of the
global batch (p ranks x b samples) is the average of the p per-rank gradients.
After an allreduce-average every rank holds that gradient; since all ranks
start from the same weights (rank 0's, broadcast once at construction) and take
the same optimizer step, they stay equal, step after step.

How the communication hides behind backward (``overlap=True``)::

    backward  | head.w block2 | block1 ... | embed |
    comm      |         [bucket 0 allreduce][bucket 1 allreduce][bucket 2][3]
                        ^ bucket 0's last gradient arrives: launch at once

1. A ``register_post_accumulate_grad_hook`` on every parameter fires when its
   gradient is final for this backward. It copies the gradient into the
   parameter's slice of its bucket (``buckets.py``) and counts the bucket down.
2. When a bucket's count reaches zero its ``comm_hook`` (default: async
   allreduce with ``op="avg"``, the division included) is launched on the communicator's
   communication thread -- *in bucket order*: bucket k starts only after buckets
   0..k-1 have started. Collectives must be issued in the same order on every
   rank, and autograd's order may differ between ranks; bucket order never does.
3. The first hook of a backward also queues a callback that autograd runs when
   the whole backward has finished (``Variable._execution_engine.queue_callback``,
   what torch's DDP uses: a last-parameter hook would not know it is the last).
   It launches what is left, waits for every bucket in order and leaves each
   ``param.grad`` as a view of the averaged bucket.

Unused parameters. A parameter that gets no gradient would leave its bucket
waiting forever. ``find_unused_parameters=True``: after each forward the
autograd graph is walked from the outputs (as torch does; ``autograd_graph.py``);
parameters not reached are marked ready (zero gradient, or what ``no_sync`` steps
accumulated) at the start of backward, so their buckets do not wait for the end. Anything
still missing at the end is marked then. One extra small allreduce per step
(a used-flag per parameter) tells which parameters no rank used: their
``grad`` stays None, as in a single process. Without the flag, a missing
gradient raises a RuntimeError at the end of backward naming the parameters.

Frozen parameters (``requires_grad=False``) are not in any bucket. A parameter
registered under two names (tied weights) is one gradient, bucketed once.

``overlap=False`` launches every bucket after backward (for comparison; what
overlap can gain at most is ``overlap.py``);
``bucket_mb=math.inf, overlap=False`` is the naive "one flat allreduce of all
gradients after backward".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..collectives import allreduce
from ..comm import Communicator, Handle, Waitable
from .autograd_graph import reachable_params, tensors_in
from .buckets import Bucket, allreduce_average, broadcast_module_state, make_buckets

CommHook = Callable[[Communicator, torch.Tensor, int], Waitable]


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves rank-averaged gradients.

    Args:
        module: the model (the same architecture on every rank).
        comm: this rank's communicator.
        bucket_mb: bucket size cap in MiB (0: one parameter per bucket; math.inf: one bucket).
        overlap: launch each bucket as soon as it is ready (else all after backward).
        find_unused_parameters: tolerate parameters that get no gradient (see module doc).
        comm_hook: ``hook(comm, flat_grad, bucket_index) -> Waitable`` whose ``wait()``
            returns the averaged flat gradient (default ``buckets.allreduce_average``). When
            it is a full ``comm.Handle`` a trace sees when the operation really ended.
        recorder: a ``minidist.trace.Recorder`` (or None): spans "forward",
            "backward" and "allreduce bucket k" (launch to completion).

    Cost per step: one collective per bucket (plus one tiny one with
    ``find_unused_parameters``); with a ring allreduce each rank sends
    2(p-1)/p x the gradient bytes.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        bucket_mb: float = 1.0,
        overlap: bool = True,
        find_unused_parameters: bool = False,
        comm_hook: CommHook | None = None,
        recorder=None,
    ) -> None:
        super().__init__()
        self.module = module
        self.comm = comm
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.comm_hook = comm_hook or allreduce_average
        self.recorder = recorder
        self.broadcast_bytes = broadcast_module_state(comm, module)
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._buckets: list[Bucket] = make_buckets(trainable, bucket_mb)
        self._where: dict[nn.Parameter, tuple[Bucket, int]] = {}
        for bucket in self._buckets:
            for slot, param in enumerate(bucket.params):
                self._where[param] = (bucket, slot)
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where]
        self._sync = True
        self._in_backward = False
        self._next_launch = 0
        self._reached: set[nn.Parameter] = set()  # params reachable from this step's outputs
        self._backward_span = None
        self._span_lock = threading.Lock()

    # --- what users see ------------------------------------------------------------
    @property
    def buckets(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [list(b.names) for b in self._buckets]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside this block only accumulates into ``param.grad`` (no
        communication); the next backward outside it allreduces the accumulated sum.
        Gradient accumulation over k micro-steps then costs one allreduce, not k::

            for micro, batch in enumerate(micro_batches):
                with ddp.no_sync() if micro < k - 1 else contextlib.nullcontext():
                    (ddp(*batch) / k).backward()

        Put forward and backward inside (as with torch's DDP); what decides is where
        backward runs."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def forward(self, *args, **kwargs):
        span = self.recorder.span("forward", cat="compute") if self.recorder else contextlib.nullcontext()
        with span:
            output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self._sync:
            roots = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
            if self.find_unused_parameters:
                self._reached |= reachable_params(roots)
            if self.recorder is not None:  # backward starts when autograd first reaches an output
                for node in roots:
                    node.register_prehook(self._on_backward_reaches_output)
        return output

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the module then trains locally again)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # --- backward: hooks ----------------------------------------------------------
    def _on_backward_reaches_output(self, grad_outputs):
        if self._backward_span is None and self._sync:
            self._backward_span = self.recorder.begin("backward", cat="compute")
        return None

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:  # no_sync: autograd has accumulated into param.grad; nothing to send
            return
        if not self._in_backward:
            self._start_backward()
        self._mark_ready(param)
        self._poll_finished()

    def _start_backward(self) -> None:
        self._in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if self.recorder is not None and self._backward_span is None:
            self._backward_span = self.recorder.begin("backward", cat="compute")
        if self.find_unused_parameters and self._reached:
            for param in self._where:
                if param not in self._reached:
                    self._mark_ready(param)

    def _mark_ready(self, param: nn.Parameter) -> None:
        bucket, slot = self._where[param]
        if bucket.ready[slot]:
            raise RuntimeError(
                f"DistributedDataParallel: parameter {bucket.names[slot]!r} got a gradient twice in one "
                "backward (or got one after it was marked unused): its bucket may already be on the "
                "wire. Do not use a module parameter outside the module's forward, and do not call "
                "backward twice on one forward without no_sync()."
            )
        view = bucket.views[slot]
        bucket.used[slot] = param.grad is not None
        if param.grad is None:
            view.zero_()  # unused here; the used-flags tell whether some other rank used it
        elif param.grad is not view:
            view.copy_(param.grad)
        param.grad = view  # from now on autograd accumulates straight into the bucket
        bucket.ready[slot] = True
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch_ready()

    def _launch_ready(self, everything: bool = False) -> None:
        """Launch buckets in index order, as far as they are ready (or all: at the end)."""
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.pending and not everything:
                return
            if self.recorder is not None:
                bucket.span = self.recorder.begin(
                    f"allreduce bucket {bucket.index}", cat="comm", bytes=bucket.nbytes
                )
            bucket.work = self.comm_hook(self.comm, bucket.buffer, bucket.index)
            if not isinstance(bucket.work, Waitable):
                raise TypeError(
                    f"comm_hook returned {type(bucket.work).__name__}, not a handle: return an object "
                    "whose wait() gives the averaged flat gradient (e.g. a comm.DerivedWork)"
                )
            bucket.launched = True
            self._next_launch += 1
            if bucket.span is not None and isinstance(bucket.work, Handle):
                # ends the span in the thread that finished the work: the true completion time
                bucket.work.add_done_callback(lambda _work, b=bucket: self._end_span(b))

    def _end_span(self, bucket: Bucket) -> None:
        with self._span_lock:
            token, bucket.span = bucket.span, None
        if token is not None:
            self.recorder.end(token)

    def _poll_finished(self) -> None:
        """Close the span of every bucket whose work has finished (for a ``Handle`` whose callback
        has not run yet; a hook's ``Waitable`` that is no ``Handle`` is seen to end at its ``wait()``)."""
        if self.recorder is None:
            return
        for bucket in self._buckets[: self._next_launch]:
            if bucket.span is not None and isinstance(bucket.work, Handle) and bucket.work.is_completed():
                self._end_span(bucket)

    # --- backward: the end ---------------------------------------------------------
    def _finish_backward(self) -> None:
        try:
            if self._backward_span is not None:
                self.recorder.end(self._backward_span)
            missing = [
                (b.names[i], p) for b in self._buckets for i, p in enumerate(b.params) if not b.ready[i]
            ]
            if missing and not self.find_unused_parameters:
                raise RuntimeError(
                    "DistributedDataParallel: these parameters received no gradient in this backward: "
                    f"{[name for name, _ in missing]}. Their buckets could never be allreduced (the other "
                    "ranks would wait forever). If they are really unused in some steps, pass "
                    "find_unused_parameters=True; if they are never trained, call "
                    "requires_grad_(False) on them before wrapping the model; or make them take "
                    "part in the loss."
                )
            for _, param in missing:
                self._mark_ready(param)
            self._launch_ready(everything=True)
            used_flags = self._launch_used_flags() if self.find_unused_parameters else None
            for bucket in self._buckets:
                self._poll_finished()
                averaged = bucket.work.wait()
                if averaged is not bucket.buffer:
                    bucket.buffer.copy_(averaged)
                if self.recorder is not None:
                    self._end_span(bucket)
            if used_flags is not None:
                counts = iter(used_flags.wait().tolist())
                for bucket in self._buckets:
                    for param in bucket.params:
                        if next(counts) == 0:  # no rank used it: no gradient, as in one process
                            param.grad = None
        finally:
            self._end_step()

    def _launch_used_flags(self):
        used = torch.tensor([float(flag) for bucket in self._buckets for flag in bucket.used])
        return allreduce(self.comm, used, op="sum", async_op=True)

    def _end_step(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        self._in_backward = False
        self._next_launch = 0
        self._reached = set()
        self._backward_span = None


__all__ = ["DistributedDataParallel", "allreduce_average"]
