"""What a submission of assignment 9 may not use: a DiLoCo, a quorum exchange or an SGD someone else wrote.

The assignment is to write Streaming DiLoCo's synchronisation (the outer Nesterov step, the
fragment schedule, the delayed apply) and the fault-tolerant step's gradient exchange and average,
so the code that already does them is off limits: the library's local SGD and DiLoCo
(``minidist.parallel.local_sgd``, every function), the fault-tolerant step's ``exchange`` and
``average_in_order`` (``minidist.parallel.elastic.step``) and ``elastic.replay`` (it sums in the
same order), ``torch.optim.SGD``, its functional ``torch.optim.sgd.sgd`` and the kernels behind it
(the outer step *is* Nesterov SGD), and ``torch.distributed``.

Allowed: ``comm.send``, ``recv``, ``isend``, ``irecv`` and, for the pseudo-gradient's average,
``md.allreduce`` -- communication is lecture 2's lesson, not this one; the grader checks the
values, not how the average travelled. The measured test counts the bytes the transport carries;
data moved any other way would not be counted, and those routes are refused.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function (and every method of their classes) is refused: none as a module --
#: the package ``minidist.parallel.local_sgd`` is refused at intake (``REFUSED_IMPORTS``, and by
#: name below) and its functions one by one at run time (``workers.student`` loads it first)
FORBIDDEN_MODULES = ()

#: other qualified names that are refused
FORBIDDEN_NAMES = (
    "minidist.parallel.local_sgd",
    "minidist.parallel.local_sgd.outer.nesterov_outer_step_",
    "minidist.parallel.local_sgd.schedule.fragments_due",
    "minidist.parallel.local_sgd.schedule.fragment_offsets",
    "minidist.parallel.local_sgd.schedule.fragment_bounds",
    "minidist.parallel.local_sgd.payload.average_async",
    "minidist.parallel.local_sgd.diloco.DiLoCo.__init__",
    "minidist.parallel.local_sgd.diloco.DiLoCo.step",
    "minidist.parallel.local_sgd.diloco.DiLoCo._launch",
    "minidist.parallel.local_sgd.diloco.DiLoCo._apply",
    "minidist.parallel.local_sgd.diloco.DiLoCo.flush",
    "minidist.parallel.elastic.step.exchange",
    "minidist.parallel.elastic.step.average_in_order",
    "minidist.parallel.elastic.average_in_order",
    "minidist.parallel.elastic.replay",  # sums the contributors in slot order too: an average by proxy
    "minidist.parallel.elastic.replay.replay",
    "torch.optim.SGD",
    "torch.optim.SGD.__init__",  # the class itself is refused at intake; at run time, its methods
    "torch.optim.SGD.step",
    "torch.optim.sgd.SGD",
    "torch.optim.sgd.sgd",
    "torch.optim.sgd._single_tensor_sgd",  # the kernels behind it (intake's private-name rule too)
    "torch.optim.sgd._multi_tensor_sgd",
    "torch.optim.sgd._fused_sgd",
    "torch._fused_sgd_",
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = (
    "torch.distributed",
    "minidist.parallel.local_sgd",
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
    "comm.send, comm.recv, comm.isend, comm.irecv, md.allreduce (for the pseudo-gradient's average) "
    "and plain torch tensor operations"
)
