"""minidist.parallel: training patterns built on the collectives.

Building blocks (variable-length messages, any-source receive) and data
parallelism: ``NaiveDataParallel`` (``ddp_naive``: the idea in one short file, one allreduce
per parameter after backward) beside ``DistributedDataParallel`` (``ddp``: hooks, buckets,
overlap, ``no_sync``, comm hooks; the buckets themselves in ``buckets``, the walk that finds
unused parameters in ``autograd_graph``, what overlap can gain at most in ``overlap``).

Model parallelism, imported by name (``from minidist.parallel import tensor as tp``):
``tensor`` (Megatron-style tensor parallel), ``pipeline`` (GPipe/1F1B schedules and their
executor), ``zero`` (ZeRO-1/2/3), ``offload`` (optimizer state in files on disk). Also
``group`` (sub-communicators), ``compression``, ``averaging`` and ``stragglers``.
Lecture 11: ``local_sgd`` (local SGD, DiLoCo and Streaming DiLoCo: talk once every H steps).
``elastic`` (a quorum per step: training goes on when ranks die, replacements recover from a
healthy peer; ``md.launch(..., elastic=elastic.Policy(...))``).
"""

from .buckets import allreduce_average
from .ddp import DistributedDataParallel
from .ddp_naive import NaiveDataParallel
from .inbox import Inbox
from .messages import recv_rows, send_rows

__all__ = [
    "DistributedDataParallel",
    "Inbox",
    "NaiveDataParallel",
    "allreduce_average",
    "recv_rows",
    "send_rows",
]
