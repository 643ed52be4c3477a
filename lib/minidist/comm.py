"""The communicator: what every worker function receives as its first argument.

A communicator knows who it is (``rank``, ``world_size``, ``local_rank``, ``device``)
and moves tensors between ranks with point-to-point operations. Everything else in
minidist (collectives, parameter servers, pipelines) is built from these four calls::

    comm.send(t, dst)        # blocks until t may be reused
    comm.recv(t, src)        # fills t in place
    h = comm.isend(t, dst)   # returns at once; h.wait() before reusing t
    h = comm.irecv(t, src)   # returns at once; h.wait() before reading t

This module declares the two types everything passes around, and nothing that moves bytes:

* ``Communicator`` -- the interface (a ``typing.Protocol``): the four calls, ``barrier``,
  the traffic counters ``stats``, and two capabilities: ``shared_workspace`` (memory every
  rank maps, or None; only the shm transport has one, and the collectives then take their
  shared-memory fast path) and ``without_shortcuts()`` (the same communicator with every
  such capability switched off, so collectives run the plain point-to-point algorithms).
* ``Handle`` -- what ``isend``/``irecv`` and every asynchronous operation return:
  ``wait()``, ``is_completed()``, ``add_done_callback(fn)``. It and the library's handles
  (``Work``, ``DerivedWork``, ...) are in ``minidist.handles``; this module re-exports them.

The transports implement ``Communicator`` in ``transport.base.BaseComm`` (validation, the
wire header, statistics, ordered async operations, barrier). A *view* of a communicator
-- the same ranks seen differently: ``PlainComm`` (no shortcuts), ``parallel.group.SubComm``
(some ranks, renumbered), ``transport.emulated.EmulatedLinkComm`` (a slower link) --
subclasses ``CommView``, which forwards every call to ``inner``, and overrides only what
it changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch

from .handles import CompletedWork, DerivedWork, Handle, Waitable, Work

__all__ = [  # the handles are part of the interface: comm.Handle, comm.Work, ...
    "CommStats",
    "CommView",
    "Communicator",
    "CompletedWork",
    "DerivedWork",
    "Handle",
    "PlainComm",
    "Waitable",
    "Work",
    "check_peer",
    "stop_collective_stream",
]


@runtime_checkable
class Communicator(Protocol):
    """What a worker function gets as ``comm``: its place in the world and point-to-point messages."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    name: str  # the transport ("pipe", "shm", "torch", ...): which cost model applies

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; returns when ``tensor`` may be modified."""
        ...

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        ...

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Start sending; do not modify ``tensor`` before ``wait()`` returns."""
        ...

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Start receiving into ``tensor``; read it only after ``wait()`` returns."""
        ...

    def barrier(self) -> None:
        """Return only after every rank has entered the barrier."""
        ...

    @property
    def stats(self) -> CommStats:
        """A snapshot of this rank's traffic counters (subtract two for a delta)."""
        ...

    def reset_stats(self) -> None: ...

    @property
    def shared_workspace(self) -> object | None:
        """Memory every rank maps (the shm transport), or None."""
        ...

    def without_shortcuts(self) -> Communicator:
        """The same ranks and messages with ``shared_workspace`` None."""
        ...

    def close(self) -> None: ...


@dataclass
class CommStats:
    """Traffic counters of one rank. Payload bytes only: headers are not counted,
    so the numbers can be compared with textbook formulas."""

    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    messages_received: int = 0

    def copy(self) -> CommStats:
        return CommStats(**vars(self))

    def __sub__(self, other: CommStats) -> CommStats:
        return CommStats(**{k: v - getattr(other, k) for k, v in vars(self).items()})


def check_peer(rank: int, world_size: int, peer: int, what: str) -> None:
    """Raise a clear error unless ``peer`` is another rank of ``0..world_size-1``."""
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise TypeError(f"rank {rank}: {what} peer must be an int rank, got {peer!r}")
    if peer == rank:
        raise ValueError(
            f"rank {rank} tried to {what} itself: point-to-point operations need "
            "another rank (copy the tensor instead)"
        )
    if not 0 <= peer < world_size:
        raise ValueError(
            f"rank {rank} tried to {what} rank {peer}, but ranks are "
            f"0..{world_size - 1} (world_size={world_size})"
        )


class CommView:
    """A communicator seen differently: every call goes to ``inner`` unless a subclass overrides it.

    Same mailboxes, same counters (``stats``), the same communication thread for async
    collectives; no shortcuts (``shared_workspace`` is None). Closing a view does not close
    ``inner``, which belongs to whoever created it. A subclass that renumbers ranks passes
    ``rank`` and ``world_size``.
    """

    def __init__(self, inner: Communicator, rank: int | None = None, world_size: int | None = None) -> None:
        self.inner = inner
        self.rank = inner.rank if rank is None else rank
        self.world_size = inner.world_size if world_size is None else world_size
        self.local_rank = inner.local_rank
        self.device = inner.device
        self.timeout: float | None = getattr(inner, "timeout", None)
        self.name: str = getattr(inner, "name", type(inner).__name__)
        self.supports_cuda: bool = getattr(inner, "supports_cuda", False)
        self.buffers_small_sends: bool = getattr(inner, "buffers_small_sends", True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def _check_peer(self, peer: int, what: str) -> None:
        check_peer(self.rank, self.world_size, peer, what)

    @property
    def stats(self) -> CommStats:
        return self.inner.stats

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.inner.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        return self.inner.recv(tensor, src, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        return self.inner.irecv(tensor, src, tag)

    def barrier(self) -> None:
        self.inner.barrier()

    @property
    def shared_workspace(self) -> object | None:
        return None

    def without_shortcuts(self) -> Communicator:
        return self  # a view has no shortcut of its own

    def close(self) -> None:
        """Nothing to release: the inner communicator belongs to whoever created it (async
        collectives issued on the view run on the inner's communication thread)."""


class PlainComm(CommView):
    """``comm.without_shortcuts()``: ``comm`` with no capability beyond point-to-point."""

    def __repr__(self) -> str:
        return f"{self.inner!r}.without_shortcuts()"


def stop_collective_stream(comm: object) -> None:
    """Stop the communication thread of ``comm``'s async collectives, if it has one.

    That thread (``collectives.async_ops``, a higher layer) parks itself on the
    communicator as ``_collective_stream``; closing lets its queued collectives run,
    then ends it. Every transport's ``close()`` calls this first (views such as
    ``PlainComm`` have no thread of their own: they use their inner communicator's).
    """
    stream = vars(comm).pop("_collective_stream", None)
    if stream is not None:
        stream.stop()
