"""minidist.parallel: training patterns built on the collectives.

Building blocks (variable-length messages, any-source receive) and data
parallelism: ``DistributedDataParallel`` (``ddp``: hooks, buckets, overlap,
``no_sync``, comm hooks; the buckets themselves in ``buckets``).
"""

from .buckets import allreduce_average
from .ddp import DistributedDataParallel
from .inbox import Inbox
from .messages import recv_rows, send_rows

__all__ = ["DistributedDataParallel", "Inbox", "allreduce_average", "recv_rows", "send_rows"]
