"""Transports: point-to-point ``send``/``recv`` written from scratch.

========  ==========================================  =====================
name      how bytes move                              reaches
========  ==========================================  =====================
"pipe"    OS pipes, one per ordered pair of ranks     one machine
"shm"     shared-memory mailboxes, no system calls    one machine
"torch"   torch.distributed (gloo: TCP, NCCL: GPU)    several machines
========  ==========================================  =====================

Each transport is a ``base.BaseComm`` subclass (``base``: validation, the wire header,
statistics, barrier; ``queues``: the per-peer threads behind ``isend``/``irecv``); ``setup``
(in the launcher) and ``connect`` (in the worker) are the two halves of building one. Read
``base``, then ``pipe``. The shm transport is four modules: ``shm_layout`` (the mailboxes'
layout and why no lock is needed), ``shm`` (``MailboxComm``: their protocol, the teaching
path; ``presence`` notices dead peers), ``shm_fastpath`` (``ShmComm``: a shortcut for
one-slot messages) and ``shm_workspace`` (the block all ranks share, for collectives).
``torch_dist`` goes over torch.distributed; ``emulated`` wraps any communicator in a slower link.
"""

from __future__ import annotations

from .pipe import PipeComm, allocate_pipes, resources_for_rank
from .shm import MailboxComm
from .shm_fastpath import ShmComm
from .shm_layout import allocate_mailboxes
from .torch_dist import TorchComm

TRANSPORTS = ("pipe", "shm", "torch")


def setup(transport: str, world_size: int):
    """Launcher side: create what the ranks will share. Returns (shared, keepalive)."""
    if transport == "pipe":
        return allocate_pipes(world_size), None
    if transport == "shm":
        return allocate_mailboxes(world_size), None
    if transport == "torch":
        import torch.distributed as dist

        # The launcher hosts the rendezvous store on an OS-assigned port: no port races.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        return {"host": "127.0.0.1", "port": store.port}, store
    raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")


def share_with_rank(transport: str, shared, rank: int, world_size: int):
    """The part of ``shared`` that rank ``rank`` needs (sent to its process)."""
    if transport == "pipe":
        return resources_for_rank(shared, rank, world_size)
    if transport == "shm":
        boxes = shared["boxes"]
        mine = {pair: box for pair, box in boxes.items() if rank in pair}
        return {**shared, "boxes": mine}
    return shared


def release_launcher_copies(transport: str, shared) -> None:
    """Launcher side, once every rank has started: drop the launcher's own copies.

    A pipe reports end-of-file to its reader (and a broken pipe to its writer)
    only when every copy of the other end is closed. The ranks hold the ends
    they use; if the launcher kept its copies, a rank waiting on a peer that has
    exited would wait for the launcher's timeout instead of raising ``PeerError``.
    """
    if transport == "pipe":
        for conn in [*shared["readers"].values(), *shared["writers"].values()]:
            conn.close()


def foreign_fds(transport: str, shared, rank: int) -> tuple[int, ...]:
    """File descriptors of other ranks' pipe ends, which a *forked* rank inherits and
    must close (for the same reason as ``release_launcher_copies``)."""
    if transport != "pipe":
        return ()
    own = {conn.fileno() for (src, dst), conn in shared["writers"].items() if src == rank}
    own |= {conn.fileno() for (src, dst), conn in shared["readers"].items() if dst == rank}
    every = {conn.fileno() for conn in [*shared["readers"].values(), *shared["writers"].values()]}
    return tuple(sorted(every - own))


def connect(transport: str, rank: int, world_size: int, resources, local_rank, device, timeout):
    """Worker side: build this rank's communicator."""
    classes = {"pipe": PipeComm, "shm": ShmComm, "torch": TorchComm}
    return classes[transport](
        rank, world_size, resources, local_rank=local_rank, device=device, timeout=timeout
    )


__all__ = [
    "TRANSPORTS",
    "MailboxComm",
    "PipeComm",
    "ShmComm",
    "TorchComm",
    "setup",
    "share_with_rank",
    "release_launcher_copies",
    "foreign_fds",
    "connect",
]
