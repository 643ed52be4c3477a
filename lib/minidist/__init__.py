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

Layers (each uses only the ones above it): ``launch`` -> transports
(``pipe``, ``shm``, ``torch``) -> collectives -> training patterns (``minidist.parallel``,
``md.DistributedDataParallel``)
-> models and data (``minidist.glove``) -> tools (``minidist.bench``).
The GloVe track is imported on its own: ``from minidist import glove``.
"""

from . import collectives
from .collectives import allgather, allreduce, barrier, broadcast, cost_model, reduce, reduce_scatter
from .comm import CommStats, Communicator, CommView, Handle, Work
from .errors import LaunchTimeout, MessageMismatch, PeerError, WorkerError
from .launch import launch
from .parallel.ddp import DistributedDataParallel
from .transport import TRANSPORTS, PipeComm, ShmComm, TorchComm

__version__ = "0.1.0"

__all__ = [
    "allgather",
    "allreduce",
    "barrier",
    "broadcast",
    "collectives",
    "cost_model",
    "reduce",
    "reduce_scatter",
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
