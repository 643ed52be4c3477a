"""What a submission of assignment 8 may not use: an all-to-all or a mixture of experts someone else wrote.

The assignment is to write the all-to-all from point-to-point messages and the expert-parallel
layer on it, so the code that already does either is off limits: every function of the library's
collectives (``minidist.collectives``: ``md.all_to_all`` and the others, with their internals),
the library's experts (``minidist.parallel.experts``: ``MoELayer``, ``ExpertParallelMoE``, its
router), the library's context parallelism (``minidist.parallel.context``: Ulysses' exchange is a
differentiable all-to-all), and ``torch.distributed`` (its ``all_to_all`` and everything else). ``comm.send``,
``comm.recv``, ``comm.isend``, ``comm.irecv`` stay allowed, and so do ``torch.autograd.Function``
and plain torch.

The measured test counts the bytes the transport carries; data moved any other way (shared
memory, files, a child process) would not be counted, and those routes are refused
(``REFUSED_IMPORTS``, ``REFUSED_ATTRIBUTES``, ``REFUSE_PROCESSES``).

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused
FORBIDDEN_MODULES = (
    "minidist.collectives",
    "minidist.parallel.experts",
    "minidist.parallel.context",  # Ulysses' differentiable all-to-all (context.ulysses.AllToAll)
)

#: other qualified names that are refused: the library's aliases of the above
FORBIDDEN_NAMES = (
    "minidist.all_to_all",
    "minidist.allreduce",
    "minidist.allgather",
    "minidist.barrier",
    "minidist.broadcast",
    "minidist.reduce",
    "minidist.reduce_scatter",
    "minidist.collectives",
    "minidist.cost_model",
    "minidist.MoELayer",
    "minidist.ExpertParallelMoE",
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = (
    "torch.distributed",
    "minidist.parallel.experts",
    "numpy",
    "mmap",
    "pickle",
    "socket",
    "subprocess",
    "multiprocessing",
    "shutil",
    "tempfile",
)

#: attribute names refused on any object: ways to move bytes past the transport
REFUSED_ATTRIBUTES = (
    "share_memory_",
    "from_file",
    "shared_workspace",
)

#: the run time guard refuses to start a process (a child could carry data past the transport)
REFUSE_PROCESSES = True

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "comm.send, comm.recv, comm.isend, comm.irecv, comm.rank, comm.world_size, "
    "torch.autograd.Function and plain torch tensor operations"
)
