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

``StudentComm(comm, record=True)`` also keeps a *transcript* (``Transcript``): every message
this rank sent, with a copy of its bytes, and every receive it completed, in this rank's order.
The trusted side of a1 pairs the transcripts of all ranks and checks that each message carries
real data the sender could have had at that moment, and that every rank received what its
result depends on (``grader/a1_collectives/reference.py``, ``check_transcripts``): an answer
computed without communicating -- or with dummy messages of the budgeted sizes -- fails.
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


class Transcript:
    """One rank's messages in the order it saw them, for the trusted side to replay.

    Events are plain dicts: ``{"op": "send", "peer", "tag", "dtype", "numel", "offset"}`` when a
    send is posted (``offset``: where a copy of its bytes starts in ``data``) and
    ``{"op": "recv", "peer", "tag", "index", "dtype", "numel"}`` when a receive *completes*
    (``index``: it is the index-th receive this rank posted from ``peer`` with ``tag``; messages
    between two ranks with one tag arrive in the order they were posted). Recording completion,
    not posting, is what makes causality checkable: data that arrived can have been used.
    """

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._chunks: list[torch.Tensor] = []
        self._size = 0
        self._posted: dict[tuple[int, int], int] = {}

    def sent(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        data = tensor.detach().reshape(-1).contiguous()
        raw = data.view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
        event = {"op": "send", "peer": int(dst), "tag": int(tag), "dtype": _dtype_name(tensor)}
        self.events.append({**event, "numel": data.numel(), "offset": self._size})
        self._chunks.append(raw.clone())
        self._size += raw.numel()

    def posted(self, src: int, tag: int) -> int:
        """Number this receive among those posted from (``src``, ``tag``)."""
        index = self._posted.get((int(src), int(tag)), 0)
        self._posted[(int(src), int(tag))] = index + 1
        return index

    def received(self, tensor: torch.Tensor, src: int, tag: int, index: int) -> None:
        event = {"op": "recv", "peer": int(src), "tag": int(tag), "index": index}
        self.events.append({**event, "dtype": _dtype_name(tensor), "numel": tensor.numel()})

    def take(self) -> dict:
        """The events and bytes so far (``{"events": [...], "data": uint8 tensor}``); starts afresh."""
        data = torch.cat(self._chunks) if self._chunks else torch.empty(0, dtype=torch.uint8)
        taken = {"events": self.events, "data": data}
        self.events, self._chunks, self._size, self._posted = [], [], 0, {}
        return taken


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


class _ReceiveWork:
    """The handle ``irecv`` returns when recording: the receive is recorded when it is seen to
    have completed (``wait()`` returned, or ``is_completed()`` said so), once."""

    def __init__(self, work, done) -> None:
        self._work, self._done = work, done

    def wait(self, timeout: float | None = None):
        result = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._finish()
        return result

    def is_completed(self) -> bool:
        completed = self._work.is_completed()
        if completed:
            self._finish()
        return completed

    def _finish(self) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def __getattr__(self, name: str):  # anything else of the library's Work (``tensor``, ...)
        return getattr(self._work, name)


class StudentComm:
    """A communicator with point-to-point operations only; the traffic counted per peer.

    ``StudentComm(comm)`` forwards every call to ``comm`` unchanged (same errors, same
    semantics) and counts a message when it is sent or posted: ``send``/``isend`` add the
    tensor's bytes to ``sent_*[dst]``, ``recv``/``irecv`` to ``received_*[src]``.

    It implements the whole ``minidist.comm.Communicator`` interface but is deliberately not a
    ``minidist.comm.CommView``: a view exposes the communicator it wraps as ``inner``, and a
    student who reached it could send without being counted (the wrapped one is ``_comm``,
    which ``forbidden.WRAPPER_PRIVATE`` refuses in a submission).
    """

    def __init__(self, comm, record: bool = False) -> None:
        self.rank: int = comm.rank
        self.world_size: int = comm.world_size
        self.local_rank: int = comm.local_rank
        self.device: torch.device = comm.device
        self.timeout: float | None = comm.timeout
        self.name: str = comm.name
        self._comm = comm
        self._traffic = Traffic.zeros(comm.world_size)
        self._transcript = Transcript() if record else None

    def __repr__(self) -> str:
        return f"StudentComm(rank={self.rank}, world_size={self.world_size})"

    def _count_sent(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if self._transcript is not None:
            self._transcript.sent(tensor, dst, tag)
        self._traffic.sent_messages[dst] += 1
        self._traffic.sent_bytes[dst] += _nbytes(tensor)

    def _count_received(self, tensor: torch.Tensor, src: int) -> None:
        self._traffic.received_messages[src] += 1
        self._traffic.received_bytes[src] += _nbytes(tensor)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to rank ``dst``; returns when ``tensor`` may be modified."""
        self._comm.send(tensor, dst, tag)
        self._count_sent(tensor, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        """Receive into ``tensor`` (same shape and dtype as the sender's) from ``src``."""
        index = None if self._transcript is None else self._transcript.posted(src, tag)
        self._comm.recv(tensor, src, tag)
        self._count_received(tensor, src)
        if index is not None:
            self._transcript.received(tensor, src, tag, index)
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0):
        """Start sending; do not modify ``tensor`` before ``wait()`` returns."""
        work = self._comm.isend(tensor, dst, tag)
        self._count_sent(tensor, dst, tag)
        return work

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0):
        """Start receiving into ``tensor``; read it only after ``wait()`` returns."""
        work = self._comm.irecv(tensor, src, tag)
        self._count_received(tensor, src)
        if self._transcript is None:
            return work
        transcript, index = self._transcript, self._transcript.posted(src, tag)
        return _ReceiveWork(work, lambda: transcript.received(tensor, src, tag, index))

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._comm.barrier()

    @property
    def shared_workspace(self) -> None:
        """None: no shortcut past point-to-point messages (they would not be counted)."""
        return None

    def without_shortcuts(self) -> StudentComm:
        return self  # it has none

    def reset_stats(self) -> None:
        """Counters are the grader's: a submission cannot reset them."""
        raise RuntimeError("the grader's communicator counts every message: its counters cannot be reset")

    def close(self) -> None:
        """Nothing to release: the wrapped communicator belongs to the grader."""

    @property
    def stats(self):
        """Totals of the counters, as the library's ``CommStats`` (``comm.stats`` works as usual)."""
        from minidist.comm import CommStats

        t = self._traffic
        return CommStats(
            sum(t.sent_bytes), sum(t.sent_messages), sum(t.received_bytes), sum(t.received_messages)
        )


def transcript(comm: StudentComm) -> dict:
    """``comm``'s transcript since the last call (``Transcript.take``); ``comm`` must record."""
    return comm._transcript.take()


def traffic(comm: StudentComm) -> dict[str, list[int]]:
    """A copy of ``comm``'s per-peer counters (for the worker's report to the trusted side)."""
    return comm._traffic.as_dict()


class CounterSeal:
    """The transport's own counters, read only if nothing of them changed since the seal was made.

    A submission runs in the process whose transport counts its bytes, so it could patch the
    classes that count (``type(comm.stats).bytes_sent = property(lambda s: 0, ...)``, a
    transport's ``_count``) through names the intake check does not follow. Make the seal when the
    worker module is imported, before the student's module is: it keeps the attributes of
    ``CommStats`` and of every class of ``minidist.transport``; ``sent(comm)`` compares them (and
    the classes of ``comm`` and its stats) before it reads, and refuses a changed one.
    """

    def __init__(self) -> None:
        import inspect
        import sys

        import minidist.comm
        import minidist.transport  # noqa: F401  (loads the transport modules)
        import minidist.transport.emulated  # noqa: F401

        classes = {minidist.comm.CommStats}
        for name, module in list(sys.modules.items()):
            if name == "minidist.comm" or name.startswith("minidist.transport"):
                classes.update(
                    c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == name
                )
        self._stats_class = minidist.comm.CommStats
        self._sealed = {cls: dict(vars(cls)) for cls in classes}

    def check(self, comm) -> None:
        stats = comm.stats
        owners = [c for c in type(comm).__mro__ if c.__module__.startswith("minidist.")]
        for cls in [*owners, type(stats)]:
            if cls not in self._sealed:
                raise AssertionError(f"the transport's counters are read from {cls!r}, which was not sealed")
            if dict(vars(cls)) != self._sealed[cls]:
                changed = sorted(k for k in set(vars(cls)) | set(self._sealed[cls])
                                 if vars(cls).get(k) is not self._sealed[cls].get(k))  # fmt: skip
                raise AssertionError(
                    f"the transport's counters were tampered with: {cls.__name__}.{', '.join(changed)} "
                    "changed while the submission ran; the measured value is not read"
                )
        if type(stats) is not self._stats_class:
            raise AssertionError("the transport's counters were replaced while the submission ran")

    def sent(self, comm) -> tuple[int, int]:
        """(bytes, messages) this rank's transport has sent, once ``check`` passes."""
        self.check(comm)
        stats = comm.stats
        return int(stats.bytes_sent), int(stats.messages_sent)
