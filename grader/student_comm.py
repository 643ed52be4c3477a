"""The communicator a submission is given: point-to-point messages only, counted per peer.

Copied into the sandbox beside ``harness.py``; standalone (torch and the standard library).
The worker modules wrap the launcher's communicator in a ``StudentComm`` before they hand it
to the student's code, so that

* there is no shortcut: ``rank``, ``world_size``, ``local_rank``, ``device``, ``timeout``,
  ``send``, ``recv``, ``isend``, ``irecv``, ``barrier`` and ``stats`` -- no shared-memory
  ``workspace``, no fast collective path, nothing else of the transport;
* the traffic is counted *here*, per peer, from the tensors that pass through: what this rank
  sent to each rank and received from each rank, in messages and payload bytes. ``traffic()``
  reads it for the trusted side, which checks that what rank i sent to j is what j received
  from i, and compares the totals with the formula of the algorithm.

Headers and the barrier's empty messages are not counted (``CommStats`` does not count headers
either, but counts a barrier's messages). What a determined submission can still forge is
listed in ``grader/README.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Traffic:
    """Per-peer counters of one rank: index ``j`` is the traffic with rank ``j``."""

    sent_messages: list[int]
    sent_bytes: list[int]
    received_messages: list[int]
    received_bytes: list[int]

    @classmethod
    def zeros(cls, world_size: int) -> Traffic:
        return cls(*([0] * world_size for _ in range(4)))

    def as_dict(self) -> dict[str, list[int]]:
        return {key: list(value) for key, value in vars(self).items()}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class StudentComm:
    """A communicator with point-to-point operations only; the traffic counted per peer.

    ``StudentComm(comm)`` forwards every call to ``comm`` unchanged (same errors, same
    semantics) and counts a message when it is sent or posted: ``send``/``isend`` add the
    tensor's bytes to ``sent_*[dst]``, ``recv``/``irecv`` to ``received_*[src]``.
    """

    def __init__(self, comm) -> None:
        self.rank: int = comm.rank
        self.world_size: int = comm.world_size
        self.local_rank: int = comm.local_rank
        self.device: torch.device = comm.device
        self.timeout: float | None = comm.timeout
        self._comm = comm
        self._traffic = Traffic.zeros(comm.world_size)

    def __repr__(self) -> str:
        return f"StudentComm(rank={self.rank}, world_size={self.world_size})"

    def _count_sent(self, tensor: torch.Tensor, dst: int) -> None:
        self._traffic.sent_messages[dst] += 1
        self._traffic.sent_bytes[dst] += _nbytes(tensor)

    def _count_received(self, tensor: torch.Tensor, src: int) -> None:
        self._traffic.received_messages[src] += 1
        self._traffic.received_bytes[src] += _nbytes(tensor)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; returns when ``tensor`` may be modified."""
        self._comm.send(tensor, dst, tag)
        self._count_sent(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        self._comm.recv(tensor, src, tag)
        self._count_received(tensor, src)
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Start sending; do not modify ``tensor`` before ``wait()`` returns."""
        work = self._comm.isend(tensor, dst, tag)
        self._count_sent(tensor, dst)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        """Start receiving into ``tensor``; read it only after ``wait()`` returns."""
        work = self._comm.irecv(tensor, src, tag)
        self._count_received(tensor, src)
        return work

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._comm.barrier()

    @property
    def stats(self):
        """Totals of the counters, as the library's ``CommStats`` (``comm.stats`` works as usual)."""
        from minidist.comm import CommStats

        t = self._traffic
        return CommStats(
            sum(t.sent_bytes), sum(t.sent_messages), sum(t.received_bytes), sum(t.received_messages)
        )


def traffic(comm: StudentComm) -> dict[str, list[int]]:
    """A copy of ``comm``'s per-peer counters (for the worker's report to the trusted side)."""
    return comm._traffic.as_dict()
