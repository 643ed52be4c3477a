"""What a submission of assignment 4 may not use: the library's gradient compressor.

The assignment is to write Deep Gradient Compression, so the course library's implementation
(``minidist.parallel.compression``: the DGC hook, its sampled threshold, its compress step, its
wire format and the baselines next to it) is off limits, and so is ``torch.distributed``
(its communication hooks). The library's DDP (``md.DistributedDataParallel``, which calls the
hook) and its collectives (``md.allgather``) stay allowed.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused
FORBIDDEN_MODULES = ("minidist.parallel.compression",)

#: other qualified names that are refused
FORBIDDEN_NAMES = ()

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = ("torch.distributed",)

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "md.allgather(comm, payload, async_op=True) and its handle's wait(), the helpers given in "
    "dgc.py (DGCConfig, DGCState, slots_for, pack, unpack) and plain torch tensor operations"
)
