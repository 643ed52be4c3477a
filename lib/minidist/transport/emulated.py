"""An emulated network link: the course machine pretends to be a cluster.

On one machine, shared memory moves a megabyte in tens of microseconds, so
every algorithm looks fast and communication hides nowhere. ``EmulatedLinkComm``
wraps any communicator and makes each message cost what it would on a slower
network, ``alpha + nbytes / bandwidth`` seconds, so that overlap, bucketing and
the choice of algorithm matter the way they do across machines::

    slow = EmulatedLinkComm(comm, alpha_s=15e-6, bandwidth_Bps=1.25e9)   # or *ETHERNET_10G
    md.allreduce(slow, grads, algorithm="ring")                           # ~ cost_model.predict

The model (Hockney's alpha-beta model with one port per rank):

* each rank has **one outgoing link**; a message occupies it for
  ``alpha + nbytes / bandwidth`` and messages leave one after another, in the
  order they were sent (``send`` or ``isend``);
* the delay is paid on the **sender's side**: the message is handed to the inner
  transport only when the link has carried it, and only then does the receiver
  see it. Receiving adds nothing, and a rank can send and receive at once;
* the inner transport's own (small) cost comes on top.

Picture, rank 0 sending a 2 MB and then a 1 MB message (alpha = 15 us, 1.25 GB/s)::

    time (ms)    0          1.6         2.4
    link 0->     [==alpha + 2MB/B==][=1MB=]
    delivered                       ^ m1   ^ m2

Why this model: it is the one ``collectives.cost_model`` counts (alpha paid per
message on the critical path, a root's messages leave one by one), so a
measurement over this link can be compared with ``cost_model.predict`` term by
term. In a ring every rank sends to one neighbour, so p ranks behave like p
independent links. Real networks pipeline latency (the next message starts
while the previous one is still in flight) and share switch bandwidth; the model
ignores both, so it overstates many small messages sent at once.

``EmulatedLinkComm`` is a view of the inner communicator (``comm.CommView``, ``inner``): same rank,
peers, mailboxes and ``stats``; ``shared_workspace`` is None (an emulated
network has no shared memory, so allreduce takes the point-to-point
algorithms); async collectives on it run on the inner communicator's
communication thread. Closing it does not close the inner communicator.
"""

from __future__ import annotations

import math
import threading
import time
from typing import NamedTuple

import torch

from ..clock import wait_until
from ..comm import Communicator, CommView, Handle, Work
from .base import BaseComm
from .queues import PeerQueues


class LinkSpec(NamedTuple):
    """A link's latency (seconds per message) and bandwidth (bytes per second).
    A tuple, so ``EmulatedLinkComm(comm, *ETHERNET_10G)`` reads naturally."""

    alpha_s: float
    bandwidth_Bps: float


#: 10 Gigabit Ethernet between two servers through the kernel's TCP stack:
#: 1.25e9 B/s is the line rate (10 Gbit/s); alpha = 15 us is in the middle of the
#: application-to-application latencies published for 10 GbE: about 10 us for an
#: isolated request on a tuned server (Larsen, Sarangam, Huggahalli, "Architectural
#: Breakdown of End-to-End Latency in a TCP/IP Network", SBAC-PAD 2007) and about
#: 20 us on commodity PCs (Hurwitz, Feng, "Initial End-to-End Performance Evaluation of
#: 10-Gigabit Ethernet", Hot Interconnects 2003).
ETHERNET_10G = LinkSpec(alpha_s=15e-6, bandwidth_Bps=1.25e9)


class Link:
    """One rank's outgoing link: hands out the time at which each message is delivered."""

    def __init__(self, alpha_s: float, bandwidth_Bps: float) -> None:
        self.alpha_s = alpha_s
        self.bandwidth_Bps = bandwidth_Bps
        self._free_at = 0.0  # perf_counter time when the link has carried everything so far
        self._lock = threading.Lock()

    def cost(self, nbytes: int) -> float:
        """Seconds a message of ``nbytes`` occupies the link: alpha + nbytes / bandwidth."""
        return self.alpha_s + nbytes / self.bandwidth_Bps

    def reserve(self, nbytes: int) -> float:
        """Queue a message on the link now; returns its delivery time (perf_counter)."""
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + self.cost(nbytes)
            return self._free_at


class EmulatedLinkComm(CommView):
    """A communicator whose messages cost ``alpha_s + nbytes / bandwidth_Bps`` (see the module)."""

    def __init__(self, inner: Communicator, alpha_s: float, bandwidth_Bps: float) -> None:
        if not (alpha_s >= 0 and math.isfinite(alpha_s)):
            raise ValueError(f"alpha_s must be a latency in seconds >= 0, got {alpha_s!r}")
        if not (bandwidth_Bps > 0):
            raise ValueError(
                f"bandwidth_Bps must be > 0 bytes/s (1.25e9 is 10 Gbit/s), got {bandwidth_Bps!r}"
            )
        if not isinstance(inner, Communicator):
            raise TypeError(f"EmulatedLinkComm wraps a communicator, got {type(inner).__name__}")
        super().__init__(inner)
        self.name = "emulated"
        self.link = Link(alpha_s, bandwidth_Bps)
        self._senders = PeerQueues(self.rank, "emulated-send")  # one thread per destination

    def __repr__(self) -> str:
        return (
            f"EmulatedLinkComm({self.inner!r}, alpha_s={self.link.alpha_s:g}, "
            f"bandwidth_Bps={self.link.bandwidth_Bps:g})"
        )

    @property
    def alpha_s(self) -> float:
        return self.link.alpha_s

    @property
    def bandwidth_Bps(self) -> float:
        return self.link.bandwidth_Bps

    # --- sending: wait for the link, then hand over (receiving costs nothing extra) ---
    def _deliver(self, tensor: torch.Tensor, dst: int, tag: int, deliver_at: float) -> None:
        wait_until(deliver_at)
        self.inner.send(tensor, dst, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Occupy the link for alpha + nbytes / bandwidth, then send through the inner communicator."""
        BaseComm._check_tensor(tensor, "send")
        self._check_peer(dst, "send to")
        deliver_at = self.link.reserve(tensor.numel() * tensor.element_size())
        self._senders.post(dst, lambda: self._deliver(tensor, dst, tag, deliver_at), None)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Like ``send``, in the background (one thread per destination keeps the order)."""
        BaseComm._check_tensor(tensor, "isend")
        self._check_peer(dst, "send to")
        deliver_at = self.link.reserve(tensor.numel() * tensor.element_size())
        work = Work(f"rank {self.rank}: isend to rank {dst} over the emulated link", tensor)
        self._senders.post(dst, lambda: self._deliver(tensor, dst, tag, deliver_at), work)
        return work

    def barrier(self) -> None:
        """The inner barrier, then the latency of its ceil(log2 p) rounds of empty messages."""
        self.inner.barrier()
        rounds = math.ceil(math.log2(self.world_size)) if self.world_size > 1 else 0
        wait_until(time.perf_counter() + rounds * self.link.alpha_s)

    def close(self) -> None:
        """Ends this view's sender threads; the inner communicator stays open."""
        self._senders.close()
