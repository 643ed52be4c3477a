"""Collectives, written once against the point-to-point interface.

``broadcast``, ``reduce``, ``allreduce`` (star, tree, ring, butterfly, shm),
``allgather``, ``reduce_scatter``, ``barrier``; ``cost_model`` predicts what
each costs. Every collective but barrier takes ``async_op=True`` and then returns
a ``CollectiveWork`` handle (``async_ops``: one communication thread per communicator).
"""

from . import cost_model
from .api import (
    ALLREDUCE_ALGORITHMS,
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
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "choose_allreduce",
    "cost_model",
    "reduce",
    "reduce_scatter",
]
