"""What a submission of assignment 1 may not use: the library's collectives, torch's collectives.

The assignment is to write collectives from point-to-point messages, so the code that already
implements them is off limits: every function of ``minidist.collectives`` (``md.allreduce``,
``md.broadcast``, ``md.reduce``, ``md.allgather``, ``md.reduce_scatter``, ``md.barrier`` and the
ring, butterfly, tree and shared-memory internals behind them) and the collectives of
``torch.distributed``. ``comm.send``, ``comm.recv``, ``comm.isend``, ``comm.irecv`` and
``comm.barrier`` stay allowed.

Plain data, read by the intake check (``grader/forbidden.py``, in the grader) and by the run
time guard (``guard.py``, in every worker process of the sandbox, where this file is copied).
"""

#: packages and modules whose every function is refused (and their submodules)
FORBIDDEN_MODULES = ("minidist.collectives",)

#: other qualified names that are refused: aliases of the above, and torch's collectives
FORBIDDEN_NAMES = (
    "minidist.allreduce",
    "minidist.allgather",
    "minidist.barrier",
    "minidist.broadcast",
    "minidist.reduce",
    "minidist.reduce_scatter",
    "minidist.collectives",
    "minidist.cost_model",
    "torch.distributed.all_reduce",
    "torch.distributed.all_reduce_coalesced",
    "torch.distributed.broadcast",
    "torch.distributed.broadcast_object_list",
    "torch.distributed.reduce",
    "torch.distributed.all_gather",
    "torch.distributed.all_gather_into_tensor",
    "torch.distributed.all_gather_object",
    "torch.distributed.all_gather_coalesced",
    "torch.distributed.reduce_scatter",
    "torch.distributed.reduce_scatter_tensor",
    "torch.distributed.all_to_all",
    "torch.distributed.all_to_all_single",
    "torch.distributed.gather",
    "torch.distributed.gather_object",
    "torch.distributed.scatter",
    "torch.distributed.scatter_object_list",
    "torch.distributed.barrier",
    "torch.distributed.monitored_barrier",
) + tuple(  # the same, one level down: the process group's own methods (written in C)
    f"torch.distributed.ProcessGroup.{method}"
    for method in (
        "allreduce",
        "allreduce_coalesced",
        "allgather",
        "allgather_coalesced",
        "allgather_into_tensor_coalesced",
        "all_gather_single",
        "broadcast",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor_coalesced",
        "alltoall",
        "alltoall_base",
        "all_to_all_single",
        "gather",
        "scatter",
        "barrier",
        "monitored_barrier",
    )
)

#: modules a submission may not import at all (intake only): nothing in the task needs them
REFUSED_IMPORTS = ("torch.distributed",)

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "comm.send, comm.recv, comm.isend, comm.irecv, comm.barrier, comm.rank, comm.world_size, "
    "plain torch tensor operations, and the helpers given in collectives.py (chunk_offsets, exchange)"
)
