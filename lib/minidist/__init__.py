"""minidist: distributed training from scratch, for learning.

    import minidist as md

    def worker(comm, scale):           # a worker's first argument is its communicator
        x = torch.full((4,), float(comm.rank + 1) * scale)
        if comm.rank == 0:
            comm.send(x, dst=1)
        elif comm.rank == 1:
            comm.recv(x, src=0)        # fills x in place
        return x                       # comes back to the launcher

    outs = md.launch(worker, world_size=2, args=(2.0,), transport="shm")

Layers. A module imports only modules of its own layer and of the layers above it in this
table (``tests/lib/test_layering.py`` reads the table from here and checks every import of
every module; a module whose first name is in no row fails it). This table is the only place
the layers are written down::

    layer        modules (the first part of the name after ``minidist.``)
    foundations  errors comm handles wire trace optim quant measure exercise clock _output _proc _stacks
    transport    transport
    collectives  collectives
    launch       launch _torchrun
    parallel     parallel
    data         data
    models       models glove
    tools        memory serve bench checkpoint

Foundations declare the types (``comm.Communicator``, ``comm.Handle``) and pure tensor math;
transports move bytes between ranks; collectives are written against the communicator only;
``launch`` starts the ranks; ``parallel`` holds the training patterns (DDP, ZeRO, tensor and
pipeline parallel, parameter servers); models and data are their users, not their home; tools
measure, serve and benchmark. ``import minidist as md`` re-exports names up to the
``parallel`` layer, so the package root counts as that layer.
The GloVe track is imported on its own: ``from minidist import glove``.
"""

from . import collectives
from .collectives import (
    all_to_all,
    allgather,
    allreduce,
    barrier,
    broadcast,
    cost_model,
    reduce,
    reduce_scatter,
)
from .comm import CommStats, Communicator, CommView, Handle, Work
from .errors import LaunchTimeout, MessageMismatch, PeerError, WorkerError
from .exercise import exercise, switched_off
from .launch import launch
from .parallel.ddp import DistributedDataParallel
from .transport import TRANSPORTS, PipeComm, ShmComm, TorchComm

__version__ = "0.1.0"

__all__ = [
    "all_to_all",
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "collectives",
    "cost_model",
    "exercise",
    "reduce",
    "reduce_scatter",
    "switched_off",
    "CommStats",
    "DistributedDataParallel",
    "Communicator",
    "CommView",
    "Handle",
    "LaunchTimeout",
    "MessageMismatch",
    "PeerError",
    "PipeComm",
    "ShmComm",
    "TRANSPORTS",
    "TorchComm",
    "Work",
    "WorkerError",
    "launch",
]
