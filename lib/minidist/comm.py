"""The communicator: what every worker function receives as its first argument.

A ``Communicator`` knows who it is (``rank``, ``world_size``, ``local_rank``,
``device``) and moves tensors between ranks with point-to-point operations.
Everything else in minidist (collectives, parameter servers, pipelines) is
built from these four calls::

    comm.send(t, dst)        # blocks until t may be reused
    comm.recv(t, src)        # fills t in place
    h = comm.isend(t, dst)   # returns at once; h.wait() before reusing t
    h = comm.irecv(t, src)   # returns at once; h.wait() before reading t

The byte-moving is left to a transport subclass (``PipeComm``, ``ShmComm``,
``TorchComm``), which implements three small methods. This base class does the
part that is the same for all of them:

* **validation** -- peers in range, not yourself, tensors only;
* **the wire header** -- every message starts with a fixed 20-integer header
  (kind, dtype, number of bytes, shape), so the receiver can check that the
  sender's tensor matches its buffer and raise a clear ``MessageMismatch``
  instead of silently reading garbage or waiting forever;
* **statistics** -- payload bytes and messages sent/received (``comm.stats``),
  which the cost-model checks of later lectures compare against formulas;
* **asynchronous operations** -- one background thread per (peer, direction),
  so messages between two ranks are delivered in the order they were posted
  (MPI's non-overtaking rule) while the caller keeps computing;
* **barrier** -- a dissemination barrier made of empty messages.

Capabilities beyond point-to-point are explicit: ``comm.shared_workspace`` is
None here, and the shm transport returns the block of memory every rank maps
(the collectives then take their shared-memory fast path).
``comm.without_shortcuts()`` hands out the same communicator with every such
capability switched off, so collectives run the plain point-to-point algorithms.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from .errors import MessageMismatch

# --- the wire header ---------------------------------------------------------
HEADER_INTS = 20  # int64 values per header
MAX_NDIM = HEADER_INTS - 5  # header: kind, dtype, nbytes, ndim, tag, shape...
KIND_DATA = 1
KIND_BARRIER = 2
_KIND_NAMES = {KIND_DATA: "a tensor", KIND_BARRIER: "a barrier message"}

# dtype <-> small integer code; the order is part of the wire format.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


def encode_header(kind: int, tensor: torch.Tensor | None, tag: int = 0) -> np.ndarray:
    """Pack (kind, dtype, nbytes, ndim, tag, shape) into ``HEADER_INTS`` int64 values."""
    header = np.zeros(HEADER_INTS, dtype=np.int64)
    header[0] = kind
    header[4] = tag
    if tensor is not None:
        if tensor.dtype not in _DTYPE_CODE:
            raise TypeError(f"minidist cannot send tensors of dtype {tensor.dtype}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(
                f"tensors with more than {MAX_NDIM} dimensions cannot be sent; "
                f"got {tensor.dim()}: reshape it first"
            )
        header[1] = _DTYPE_CODE[tensor.dtype]
        header[2] = tensor.numel() * tensor.element_size()
        header[3] = tensor.dim()
        header[5 : 5 + tensor.dim()] = tensor.shape
    return header


def describe_header(header: np.ndarray) -> str:
    kind = int(header[0])
    if kind != KIND_DATA:
        return _KIND_NAMES.get(kind, f"an unknown message (kind {kind})")
    dtype = DTYPES[int(header[1])]
    shape = tuple(int(s) for s in header[5 : 5 + int(header[3])])
    tag = f", tag {int(header[4])}" if header[4] else ""
    return f"a {str(dtype).removeprefix('torch.')} tensor of shape {shape} ({int(header[2])} bytes{tag})"


def _describe_tensor(t: torch.Tensor) -> str:
    dtype = str(t.dtype).removeprefix("torch.")
    return f"a {dtype} tensor of shape {tuple(t.shape)} ({t.numel() * t.element_size()} bytes)"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (works for bfloat16 and bool too)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


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


_CALLBACK_LOCK = threading.Lock()  # orders add_done_callback against _finish (rarely contended)


class Work:
    """Handle of an ``isend``/``irecv``. ``wait()`` blocks until the operation is
    done and re-raises its error, if any; ``is_completed()`` does not block.
    ``add_done_callback(fn)`` calls ``fn(work)`` when it finishes (at once if it
    already has), in the thread that finished it -- how a trace learns when a
    message really ended rather than when someone got round to waiting for it."""

    _callbacks: list | None = None

    def __init__(self, description: str, tensor: torch.Tensor | None = None) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._description = description
        self.tensor = tensor

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        with _CALLBACK_LOCK:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            callback(self)

    def add_done_callback(self, callback) -> None:
        with _CALLBACK_LOCK:
            if not self.is_completed():
                self._callbacks = [*(self._callbacks or ()), callback]
                return
        callback(self)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._description} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.tensor


class CompletedWork(Work):
    """The handle of an operation that finished before ``isend`` returned
    (e.g. a small message copied straight into a free mailbox slot)."""

    def __init__(self, tensor: torch.Tensor | None = None) -> None:  # no Event: it is cheap
        self.tensor = tensor
        self._error = None

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor | None:
        return self.tensor


class _PeerQueue:
    """A FIFO of operations towards one peer, run by one daemon thread.

    ``pending`` counts posted-but-unfinished operations; a blocking call runs
    inline only when nothing is pending, otherwise it queues behind the async
    ones so that the order of messages between two ranks is the posting order.
    """

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            func, work = job
            try:
                func()
            except BaseException as error:  # handed to whoever waits on the work
                work._finish(error)
            else:
                work._finish()
            finally:
                with self.lock:
                    self.pending -= 1


class Communicator:
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
        self._send_queues: dict[int, _PeerQueue] = {}
        self._recv_queues: dict[int, _PeerQueue] = {}
        self._queues_lock = threading.Lock()

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
        if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
            raise TypeError(f"rank {self.rank}: {what} peer must be an int rank, got {peer!r}")
        if peer == self.rank:
            raise ValueError(
                f"rank {self.rank} tried to {what} itself: point-to-point operations need "
                "another rank (copy the tensor instead)"
            )
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"rank {self.rank} tried to {what} rank {peer}, but ranks are "
                f"0..{self.world_size - 1} (world_size={self.world_size})"
            )

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
        self._post(dst, self._send_queues, lambda: self._do_send(KIND_DATA, tensor, dst, tag), None)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        self._check_tensor(tensor, "recv")
        self._check_peer(src, "receive from")
        self._post(src, self._recv_queues, lambda: self._do_recv(KIND_DATA, tensor, src, tag), None)
        return tensor

    # --- non-blocking operations ---------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending; do not modify ``tensor`` before ``wait()`` returns."""
        self._check_tensor(tensor, "isend")
        self._check_peer(dst, "send to")
        work = Work(f"rank {self.rank}: isend to rank {dst}", tensor)
        self._post(dst, self._send_queues, lambda: self._do_send(KIND_DATA, tensor, dst, tag), work)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor``; read it only after ``wait()`` returns."""
        self._check_tensor(tensor, "irecv")
        self._check_peer(src, "receive from")
        work = Work(f"rank {self.rank}: irecv from rank {src}", tensor)
        self._post(src, self._recv_queues, lambda: self._do_recv(KIND_DATA, tensor, src, tag), work)
        return work

    def _post(self, peer: int, queues: dict[int, _PeerQueue], func, work: Work | None) -> None:
        """Run ``func`` inline if nothing is queued towards ``peer``, else queue it.

        With ``work=None`` (a blocking call) we wait for it either way.
        """
        peer_queue = queues.get(peer)
        if work is None:
            if peer_queue is None or peer_queue.pending == 0:
                func()  # the fast path: no thread hand-off
                return
            work = Work(f"rank {self.rank}: operation with rank {peer}")
            self._enqueue(peer, queues, func, work)
            work.wait()
            return
        self._enqueue(peer, queues, func, work)

    def _enqueue(self, peer: int, queues: dict[int, _PeerQueue], func, work: Work) -> None:
        with self._queues_lock:
            peer_queue = queues.get(peer)
            if peer_queue is None:
                direction = "send" if queues is self._send_queues else "recv"
                peer_queue = _PeerQueue(f"minidist-{direction}-{self.rank}-{peer}")
                queues[peer] = peer_queue
        with peer_queue.lock:
            peer_queue.pending += 1
        peer_queue.jobs.put((func, work))

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
            want = "a barrier message" if tensor is None else _describe_tensor(tensor)
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
                self._post(dst, self._send_queues, send, None)
                self._post(src, self._recv_queues, recv, None)
            else:  # the send may wait for the matching recv: post it asynchronously
                work = Work(f"rank {self.rank}: barrier send to rank {dst}")
                self._post(dst, self._send_queues, send, work)
                self._post(src, self._recv_queues, recv, None)
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
        for queues in (self._send_queues, self._recv_queues):
            for peer_queue in queues.values():
                peer_queue.jobs.put(None)
            queues.clear()

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


class PlainComm(Communicator):
    """A view of another communicator with no capability beyond point-to-point.

    ``send``/``recv``/``isend``/``irecv``/``barrier`` and ``stats`` are the inner
    communicator's (same mailboxes, same counters); ``shared_workspace`` is None.
    Closing the view does not close the communicator it wraps.
    """

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner.rank, inner.world_size, inner.local_rank, inner.device, inner.timeout)
        self.inner = inner
        self.name = inner.name
        self.supports_cuda = inner.supports_cuda
        self.buffers_small_sends = inner.buffers_small_sends

    def __repr__(self) -> str:
        return f"{self.inner!r}.without_shortcuts()"

    @property
    def stats(self) -> CommStats:
        return self.inner.stats

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.inner.send(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        return self.inner.recv(tensor, src, tag)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        return self.inner.isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        return self.inner.irecv(tensor, src, tag)

    def barrier(self) -> None:
        self.inner.barrier()

    def without_shortcuts(self) -> Communicator:
        return self

    def close(self) -> None:
        """Nothing to release: the inner communicator belongs to whoever created it (its
        async collectives, the view's included, run on the inner's communication thread)."""
