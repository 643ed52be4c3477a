"""The transports' base class: point-to-point messages, made the same way for every transport.

``BaseComm`` implements the ``Communicator`` interface (``minidist.comm``) on top of
three small methods that a transport subclass (``PipeComm``, ``ShmComm``, ``TorchComm``)
provides. This class does the part that is the same for all of them:

* **validation** -- peers in range, not yourself, tensors only;
* **the wire header** (``minidist.wire``) -- written in front of every message and
  checked against the receiver's buffer, so a mismatch raises ``MessageMismatch``;
* **statistics** -- payload bytes and messages sent/received (``comm.stats``);
* **asynchronous operations** -- one background thread per (peer, direction)
  (``queues.PeerQueues``), so messages between two ranks are delivered in the order they
  were posted (MPI's non-overtaking rule) while the caller keeps computing;
* **barrier** -- a dissemination barrier made of empty messages.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import torch

from ..comm import CommStats, Communicator, PlainComm, Work, check_peer, stop_collective_stream
from ..errors import MessageMismatch
from ..wire import KIND_BARRIER, KIND_DATA, as_bytes, describe_header, describe_tensor, encode_header
from .queues import PeerQueues


class BaseComm:
    """Base class of the transports; see the module docstring.

    Subclasses implement:

    * ``_send_message(header, payload, dst)`` -- deliver a header (int64 numpy
      array) and a payload (flat uint8 tensor, possibly empty) to ``dst``;
    * ``_recv_header(src)`` -- wait for the next message from ``src`` and
      return its header without consuming the payload;
    * ``_recv_payload(out, header, src)`` -- consume the payload into the flat
      uint8 tensor ``out`` of exactly ``header[2]`` bytes;
    * ``close()`` -- release resources.
    """

    name = "base"
    #: whether payloads may live on a CUDA device (else they are staged via CPU)
    supports_cuda = False
    #: whether a small send completes without a matching recv being posted
    #: (true for pipes and mailboxes, which buffer; not for torch.distributed)
    buffers_small_sends = True

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        device: str | torch.device = "cpu",
        timeout: float | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.device = torch.device(device)
        self.timeout = timeout
        self._stats = CommStats()
        self._stats_lock = threading.Lock()
        self._send_queues = PeerQueues(rank, "send")
        self._recv_queues = PeerQueues(rank, "recv")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"local_rank={self.local_rank}, device={str(self.device)!r})"
        )

    # --- statistics ----------------------------------------------------------
    @property
    def stats(self) -> CommStats:
        """A snapshot of the traffic counters (subtract two snapshots for a delta)."""
        with self._stats_lock:
            return self._stats.copy()

    def reset_stats(self) -> None:
        with self._stats_lock:
            self._stats = CommStats()

    def _count(self, sent: bool, nbytes: int) -> None:
        with self._stats_lock:
            if sent:
                self._stats.bytes_sent += nbytes
                self._stats.messages_sent += 1
            else:
                self._stats.bytes_received += nbytes
                self._stats.messages_received += 1

    # --- validation ----------------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        check_peer(self.rank, self.world_size, peer, what)

    @staticmethod
    def _check_tensor(t: object, what: str) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what} expects a torch.Tensor, got {type(t).__name__}")

    def _payload_of(self, t: torch.Tensor) -> torch.Tensor:
        """Contiguous bytes to send (staged to CPU when the transport needs it)."""
        t = t.detach()
        if t.is_cuda and not self.supports_cuda:
            t = t.cpu()
        return as_bytes(t.contiguous())

    # --- blocking operations -------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; returns when ``tensor`` may be modified."""
        self._check_tensor(tensor, "send")
        self._check_peer(dst, "send to")
        self._send_queues.post(dst, lambda: self._do_send(KIND_DATA, tensor, dst, tag), None)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        self._check_tensor(tensor, "recv")
        self._check_peer(src, "receive from")
        self._recv_queues.post(src, lambda: self._do_recv(KIND_DATA, tensor, src, tag), None)
        return tensor

    # --- non-blocking operations ---------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending; do not modify ``tensor`` before ``wait()`` returns."""
        self._check_tensor(tensor, "isend")
        self._check_peer(dst, "send to")
        work = Work(f"rank {self.rank}: isend to rank {dst}", tensor)
        self._send_queues.post(dst, lambda: self._do_send(KIND_DATA, tensor, dst, tag), work)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor``; read it only after ``wait()`` returns."""
        self._check_tensor(tensor, "irecv")
        self._check_peer(src, "receive from")
        work = Work(f"rank {self.rank}: irecv from rank {src}", tensor)
        self._recv_queues.post(src, lambda: self._do_recv(KIND_DATA, tensor, src, tag), work)
        return work

    # --- the protocol on top of the subclass' three methods ------------------
    def _do_send(self, kind: int, tensor: torch.Tensor | None, dst: int, tag: int = 0) -> None:
        header = encode_header(kind, tensor, tag)
        payload = torch.empty(0, dtype=torch.uint8) if tensor is None else self._payload_of(tensor)
        self._send_message(header, payload, dst)
        self._count(True, payload.numel())

    def _do_recv(self, kind: int, tensor: torch.Tensor | None, src: int, tag: int = 0) -> None:
        header = self._recv_header(src)
        expected = encode_header(kind, tensor, tag)
        if not np.array_equal(header, expected):
            want = "a barrier message" if tensor is None else describe_tensor(tensor)
            if tag:
                want += f" with tag {tag}"
            if header[0] != expected[0]:
                hint = "the ranks called different operations (e.g. one is in barrier())"
            elif np.array_equal(header[:4], expected[:4]) and header[4] != expected[4]:
                hint = "the tags differ: the ranks are in different operations, or disagree on them"
            else:
                hint = "tensors differ in shape or dtype across ranks"
            raise MessageMismatch(
                f"rank {self.rank} received {describe_header(header)} from rank {src}, "
                f"but expected {want}: {hint}"
            )
        nbytes = int(header[2])
        if tensor is None:
            self._recv_payload(torch.empty(0, dtype=torch.uint8), header, src)
        else:
            direct = tensor.is_contiguous() and (self.supports_cuda or not tensor.is_cuda)
            target = (
                tensor
                if direct
                else torch.empty(tensor.shape, dtype=tensor.dtype, device=self._staging(tensor))
            )
            self._recv_payload(as_bytes(target.detach()), header, src)
            if not direct:
                with torch.no_grad():
                    tensor.copy_(target)
        self._count(False, nbytes)

    def _staging(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device if (self.supports_cuda or not tensor.is_cuda) else torch.device("cpu")

    # --- barrier -------------------------------------------------------------
    def barrier(self) -> None:
        """Return only after every rank has entered the barrier.

        Dissemination barrier: in round k, rank r tells rank r + 2^k and hears
        from rank r - 2^k (mod p). After ceil(log2 p) rounds every rank has
        heard, directly or through others, from every rank. Messages are
        empty; cost: ceil(log2 p) latencies.
        """
        p = self.world_size
        for k in range(math.ceil(math.log2(p)) if p > 1 else 0):
            step = 1 << k
            dst, src = (self.rank + step) % p, (self.rank - step) % p
            send = lambda d=dst: self._do_send(KIND_BARRIER, None, d)  # noqa: E731
            recv = lambda s=src: self._do_recv(KIND_BARRIER, None, s)  # noqa: E731
            if self.buffers_small_sends:
                self._send_queues.post(dst, send, None)
                self._recv_queues.post(src, recv, None)
            else:  # the send may wait for the matching recv: post it asynchronously
                work = Work(f"rank {self.rank}: barrier send to rank {dst}")
                self._send_queues.post(dst, send, work)
                self._recv_queues.post(src, recv, None)
                work.wait()

    # --- to implement --------------------------------------------------------
    def _send_message(self, header: np.ndarray, payload: torch.Tensor, dst: int) -> None:
        raise NotImplementedError

    def _recv_header(self, src: int) -> np.ndarray:
        raise NotImplementedError

    def _recv_payload(self, out: torch.Tensor, header: np.ndarray, src: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        stop_collective_stream(self)
        self._send_queues.close()
        self._recv_queues.close()

    def _deadline(self) -> float:
        return math.inf if self.timeout is None else time.monotonic() + self.timeout

    # --- capabilities ----------------------------------------------------------
    @property
    def shared_workspace(self) -> object | None:
        """Memory that every rank of this communicator maps, or None (the default).

        Only the shm transport has one (a ``transport.shm_workspace.SharedWorkspace``);
        ``md.allreduce`` asks for it to choose its shared-memory algorithm.
        """
        return None

    def without_shortcuts(self) -> Communicator:
        """This communicator without its speed paths: the same rank, peers, messages and
        ``stats``, but ``shared_workspace`` is None, so collectives called on it run the
        point-to-point algorithms (what a student's code must be measured against)."""
        return PlainComm(self)
