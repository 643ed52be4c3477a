"""What a submission of assignment 3 may not use: a data-parallel wrapper someone else wrote.

The assignment is to write bucketed, overlapping data parallelism, so the implementations that
already exist are off limits: the course library's (``minidist.parallel.ddp``, also exported as
``md.DistributedDataParallel``; its naive version ``minidist.parallel.ddp_naive`` and its
autograd-graph helpers), torch's (``torch.nn.parallel.DistributedDataParallel``, and its module
``torch.nn.parallel.distributed``), and ``torch.distributed`` altogether (its collectives, its
communication hooks). The library's bucket module (``minidist.parallel.buckets``: its buckets and
``allreduce_average``) is refused too: the grader counts ``md.allreduce`` calls. The library's
collectives stay allowed -- the task is to *use* ``md.allreduce(comm, flat, op="sum",
async_op=True)`` well -- and so does ``md.broadcast``.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused: the library's
#: DDP, its naive teaching version and its autograd-graph helpers, and its buckets
#: (``allreduce_average`` calls the collectives under its own name, which the grader's count of
#: ``md.allreduce`` calls would not see)
FORBIDDEN_MODULES = (
    "minidist.parallel.ddp",
    "minidist.parallel.ddp_naive",
    "minidist.parallel.autograd_graph",
    "minidist.parallel.buckets",
)

#: other qualified names that are refused: the wrappers under the names they are exported as.
#: torch's module ``torch.nn.parallel.distributed`` is not refused whole (its helpers are torch's
#: internals); its class is, by name at intake and through its methods at run time.
FORBIDDEN_NAMES = (
    "minidist.DistributedDataParallel",
    "minidist.parallel.DistributedDataParallel",
    "minidist.parallel.NaiveDataParallel",
    "torch.nn.parallel.distributed",
    "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.DistributedDataParallel",
) + tuple(
    f"torch.nn.parallel.DistributedDataParallel.{method}"
    for method in ("__init__", "forward", "no_sync", "register_comm_hook", "_sync_buffers")
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = ("torch.distributed",)

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "md.allreduce(comm, flat, op='sum', async_op=True) and its handle's wait(), md.broadcast, "
    "param.register_post_accumulate_grad_hook, the helpers given in ddp.py "
    "(call_when_backward_ends, broadcast_parameters, Bucket) and plain torch tensor operations"
)
