"""Ordered asynchronous operations: one background thread per (peer, direction).

``isend``/``irecv`` return at once; the work is done by a daemon thread that owns all
operations towards one peer in one direction, in the order they were posted. So messages
between two ranks are delivered in posting order (MPI's non-overtaking rule) while the
caller keeps computing, and a blocking call that finds nothing queued runs inline, with no
thread hand-off (the fast path). ``transport.base.BaseComm`` keeps one ``PeerQueues`` for
sends and one for receives; ``EmulatedLinkComm`` one for its delayed sends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from ..comm import Work


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


class PeerQueues(dict[int, _PeerQueue]):
    """The ``_PeerQueue`` of each peer, for one direction of one rank (created on first use)."""

    def __init__(self, rank: int, direction: str) -> None:
        super().__init__()
        self.rank, self.direction = rank, direction
        self._lock = threading.Lock()

    def idle(self, peer: int) -> bool:
        """Nothing posted towards ``peer`` is still unfinished."""
        peer_queue = self.get(peer)
        return peer_queue is None or peer_queue.pending == 0

    def post(self, peer: int, func: Callable[[], None], work: Work | None) -> None:
        """Run ``func`` inline if nothing is queued towards ``peer``, else queue it.

        With ``work=None`` (a blocking call) we wait for it either way.
        """
        if work is None:
            if self.idle(peer):
                func()  # the fast path: no thread hand-off
                return
            work = Work(f"rank {self.rank}: operation with rank {peer}")
            self._enqueue(peer, func, work)
            work.wait()
            return
        self._enqueue(peer, func, work)

    def _enqueue(self, peer: int, func: Callable[[], None], work: Work) -> None:
        with self._lock:
            peer_queue = self.get(peer)
            if peer_queue is None:
                peer_queue = self[peer] = _PeerQueue(f"minidist-{self.direction}-{self.rank}-{peer}")
        with peer_queue.lock:
            peer_queue.pending += 1
        peer_queue.jobs.put((func, work))

    def close(self) -> None:
        """End every thread (after the jobs already queued)."""
        for peer_queue in self.values():
            peer_queue.jobs.put(None)
        self.clear()
