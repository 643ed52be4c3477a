"""Layer 3: collectives, written once against the point-to-point interface.

``broadcast``, ``reduce``, ``allreduce`` (star, tree, ring, butterfly, shm),
``allgather``, ``reduce_scatter``, ``barrier``; ``cost_model`` predicts what
each costs.
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
from .ops import OPS

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "OPS",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "choose_allreduce",
    "cost_model",
    "reduce",
    "reduce_scatter",
]
