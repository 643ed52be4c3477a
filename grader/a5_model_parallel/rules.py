"""What a submission of assignment 5 may not use: anyone else's tensor or pipeline parallelism.

The assignment is to write the Megatron MLP split and the 1F1B schedule with its stage step,
so the course library's versions (``minidist.parallel.tensor``, ``minidist.parallel.pipeline``,
and the models built from them, ``minidist.models.tp_decoder`` and ``minidist.models.stages``)
are off limits, and so is ``torch.distributed`` (its collectives, ``torch.distributed.tensor
.parallel`` and ``torch.distributed.pipelining``). The library's collectives (``md.allreduce``,
``md.allgather``) and point-to-point messages (``comm.send``/``comm.recv``) stay allowed: they
are the primitives.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused. torch's
#: ``torch.distributed.tensor.parallel`` and ``torch.distributed.pipelining`` are refused at intake
#: (``REFUSED_IMPORTS``: all of ``torch.distributed``), not here: the guard imports what it lists
#: to neuter it, and those two cost 2 s in every worker process.
FORBIDDEN_MODULES = (
    "minidist.parallel.tensor",
    "minidist.parallel.pipeline",
    "minidist.models.tp_decoder",
    "minidist.models.stages",
)

#: other qualified names that are refused: torch.distributed's collectives and point-to-point
FORBIDDEN_NAMES = tuple(
    f"torch.distributed.{name}"
    for name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "broadcast",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    )
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = ("torch.distributed", "subprocess", "multiprocessing")

#: attribute names refused on any object: what would reach the grader's layers while the stage
#: runs them (saved-tensor hooks see every tensor autograd saves, torch-function and dispatch
#: modes every call with the weights as arguments); the stage refuses them at run time too
REFUSED_ATTRIBUTES = (
    "saved_tensors_hooks",
    "save_on_cpu",
    "register_saved_tensors_default_hooks",
    "TorchFunctionMode",
    "TorchDispatchMode",
    "__torch_function__",
    "__torch_dispatch__",
)

#: the run time guard refuses to start a process (a child could copy the library's files)
REFUSE_PROCESSES = True

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "md.allreduce (and md.allgather through the given gather/scatter helpers) inside your own "
    "autograd Functions, comm.send / comm.recv for the pipeline, and plain torch"
)
