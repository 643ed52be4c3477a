"""What a submission of assignment 2 may not use: the library's parameter server and Hogwild.

The course library trains GloVe with a parameter server and with Hogwild
(``minidist.glove.trainers.param_server`` and ``.hogwild``, wrapped by ``glove.train_param_server``
and ``glove.train_hogwild``); the assignment is to write them. The building blocks the stub
imports stay allowed: ``GloveConfig``, ``Pairs``, ``adagrad_update``, ``batch_step``,
``pair_gradients``, ``batch_slices``, ``split``, ``Inbox``, ``send_rows`` and ``recv_rows``.

Plain data, read by the intake check (``grader/forbidden.py``) and by the run time guard
(``guard.py``, copied into the sandbox).
"""

#: modules whose every function is refused
FORBIDDEN_MODULES = (
    "minidist.glove.trainers.param_server",
    "minidist.glove.trainers.hogwild",
)

#: other qualified names that are refused (the public wrappers, under every name they are exported)
FORBIDDEN_NAMES = (
    "minidist.glove.train_param_server",
    "minidist.glove.train_hogwild",
    "minidist.glove.trainers.train_param_server",
    "minidist.glove.trainers.train_hogwild",
)

#: modules a submission may not import at all (intake only)
REFUSED_IMPORTS = ("torch.distributed",)

#: what to use instead (the feedback says so)
ALLOWED_INSTEAD = (
    "comm.send/recv/isend/irecv/barrier, send_rows, recv_rows, Inbox, read_request, batch_slices, "
    "split, pair_gradients, adagrad_update, batch_step and GloveConfig"
)
