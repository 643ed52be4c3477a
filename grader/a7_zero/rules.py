"""What a submission of assignment 7 may not use: a ZeRO someone else wrote, or memory torch cannot see.

The assignment is to shard AdamW's state and the gradients (ZeRO-2) and the weights (ZeRO-3)
on the library's collectives, so the implementations that exist are off limits: the course
library's (``minidist.parallel.zero``: ``ZeroOptimizer``, ``FullyShardedModule``; the trainer
built on them, ``minidist.models.zero_training``) and torch's (FSDP,
``ZeroRedundancyOptimizer``: all of ``torch.distributed``). The library's collectives stay
allowed -- the task is to *use* ``md.reduce_scatter`` and ``md.allgather`` -- and so do
``torch.optim.AdamW`` over tensors the submission owns and ``torch.utils.checkpoint``.

The measured test counts the bytes torch allocates (its profiler, in the worker): memory held
outside torch's allocator -- numpy arrays, Python lists of numbers, shared-memory or pinned
storages -- would not be counted, and turning the profiler off would hide everything. Those
routes are refused at intake (``REFUSED_IMPORTS``, ``REFUSED_ATTRIBUTES``).

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused
FORBIDDEN_MODULES = (
    "minidist.parallel.zero",
    "minidist.parallel.zero.optimizer",
    "minidist.parallel.zero.fully_sharded",
    "minidist.models.zero_training",
)

#: other qualified names that are refused
FORBIDDEN_NAMES = ()

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = (
    "torch.distributed",
    "torch.profiler",
    "torch.autograd.profiler",
    "numpy",
    "array",
    "mmap",
    "struct",
    "subprocess",
    "multiprocessing",
    "torch.multiprocessing",
    # threads: torch's profiler counts the allocations of the thread it runs in, so work moved to
    # another thread would vanish from the measured peak (the library's collectives keep their own
    # communication thread; async_op=True is the way to overlap)
    "threading",
    "concurrent",
    "asyncio",
)

#: attribute names refused on any object: ways to hold numbers outside torch's allocator, or to
#: stop the profiler that counts it
REFUSED_ATTRIBUTES = (
    "profiler",
    "tolist",
    "item",
    "numpy",
    "from_numpy",
    "frombuffer",
    "share_memory_",
    "pin_memory",
    "set_",
)

#: the run time guard refuses to start a process (a child could copy the library's files)
REFUSE_PROCESSES = True

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "md.reduce_scatter, md.allgather (async_op=True for prefetching) and md.broadcast on the "
    "communicator you are given, torch.optim.AdamW over tensors you own, torch.utils.checkpoint "
    "and plain torch tensor operations"
)
