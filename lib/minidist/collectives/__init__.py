"""Collectives, written once against the point-to-point interface.

``broadcast``, ``reduce``, ``allreduce`` (star, tree, ring, butterfly, shm),
``allgather``, ``reduce_scatter``, ``all_to_all``, ``barrier``; ``cost_model``
predicts what each costs. Every collective but barrier takes ``async_op=True`` and
then returns a ``CollectiveWork`` handle (``async_ops``: one communication thread
per communicator).

Modules, in reading order: ``rooted`` (star and tree broadcast and reduce), ``ring``,
``butterfly``, ``all_to_all`` (pairwise exchange), ``ops`` (operators, chunking);
``api`` (the public functions; their checks in ``checks``, agreement between ranks
through ``signature``); ``shm_allreduce`` and ``shm_sync`` (the shared-memory speed
path); ``async_ops`` (``async_op=True``); ``cost_model``.
"""

from . import cost_model
from .api import (
    ALLREDUCE_ALGORITHMS,
    all_to_all,
    allgather,
    allreduce,
    barrier,
    broadcast,
    choose_allreduce,
    reduce,
    reduce_scatter,
)
from .async_ops import CollectiveStreamError, CollectiveWork
from .ops import OPS

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "OPS",
    "CollectiveStreamError",
    "CollectiveWork",
    "all_to_all",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "choose_allreduce",
    "cost_model",
    "reduce",
    "reduce_scatter",
]
